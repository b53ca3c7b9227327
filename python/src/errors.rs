//! `StarlingError` and its subclasses, and how Rust errors map onto them: the message is the
//! Rust error's whole cause chain.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use starling_averager::AveragerError;
use starling_node::NodeError;

create_exception!(
    starling,
    StarlingError,
    PyException,
    "Every error Starling raises."
);
create_exception!(
    starling,
    TimeoutError,
    StarlingError,
    "A network wait ran out of time (a deadline, a dial, a DHT query)."
);
create_exception!(
    starling,
    NoGroupError,
    StarlingError,
    "No averaging group formed before the deadline (too few peers searched)."
);
create_exception!(
    starling,
    SchemaMismatchError,
    StarlingError,
    "The other peers of the run average other tensor sizes, order or codec."
);
create_exception!(
    starling,
    NodeClosedError,
    StarlingError,
    "The node has shut down (or its background task stopped): every later call raises this."
);

/// Adds the exception classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("StarlingError", py.get_type::<StarlingError>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("NoGroupError", py.get_type::<NoGroupError>())?;
    m.add("SchemaMismatchError", py.get_type::<SchemaMismatchError>())?;
    m.add("NodeClosedError", py.get_type::<NodeClosedError>())?;
    Ok(())
}

/// The Python exception for a node error.
pub(crate) fn node_error(e: NodeError) -> PyErr {
    let text = starling_node::error_chain(&e);
    match e {
        NodeError::Closed => NodeClosedError::new_err(text),
        NodeError::Timeout(_) => TimeoutError::new_err(text),
        _ => StarlingError::new_err(text),
    }
}

/// The Python exception for an averager error.
pub(crate) fn averager_error(e: AveragerError) -> PyErr {
    match e {
        AveragerError::Node(e) => node_error(e),
        e => {
            let text = starling_node::error_chain(&e);
            match e {
                AveragerError::NoGroup { .. } => NoGroupError::new_err(text),
                AveragerError::SchemaMismatch { .. } => SchemaMismatchError::new_err(text),
                AveragerError::Deadline(_) => TimeoutError::new_err(text),
                AveragerError::InvalidWeight(_) | AveragerError::NonFinite(_) => {
                    pyo3::exceptions::PyValueError::new_err(text)
                }
                _ => StarlingError::new_err(text),
            }
        }
    }
}
