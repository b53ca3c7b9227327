//! The `starling._native` extension module: Python classes over Starling's library crates.
//!
//! Everything a call does runs on one tokio runtime per process (the `runtime` module), with
//! the GIL released for as long as it waits on the network ([`Python::detach`]), so other
//! Python threads keep running during a round. Tensors cross without copies: the `tensors`
//! module reads each numpy array's `__array_interface__` (float32, C-contiguous, writable) and
//! the averager writes the result into the array's own memory. The Python package `starling`
//! (next to this crate) re-exports these classes and adds `starling.torch`.

use pyo3::prelude::*;

mod averager;
mod datasets;
mod errors;
mod gossip;
mod node;
mod runtime;
mod slot;
mod tensors;
mod training;

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<node::PyNode>()?;
    m.add_class::<averager::PyAverager>()?;
    m.add_class::<averager::PyRoundReport>()?;
    m.add_class::<gossip::PyGossipAverager>()?;
    m.add_class::<gossip::PyGossipReport>()?;
    m.add_class::<training::PyCollaborative>()?;
    m.add_class::<training::FlatBuffer>()?;
    m.add_class::<training::PyStepReport>()?;
    m.add_function(wrap_pyfunction!(runtime::log_to_stderr, m)?)?;
    m.add_function(wrap_pyfunction!(datasets::digits, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
