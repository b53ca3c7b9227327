//! An averager shared by its Python object and the steps in flight.

use std::sync::{Arc, Mutex, PoisonError};

use pyo3::prelude::*;

use crate::errors::NodeClosedError;

/// Holds `T` until shutdown; steps borrow it as an `Arc` so that a shutdown from another
/// thread never frees it under a running step.
pub(crate) struct Slot<T>(Mutex<Option<Arc<T>>>);

impl<T> Slot<T> {
    pub(crate) fn new(value: T) -> Self {
        Slot(Mutex::new(Some(Arc::new(value))))
    }

    /// The value, or `NodeClosedError` saying that `what` has shut down.
    pub(crate) fn get(&self, what: &str) -> PyResult<Arc<T>> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| NodeClosedError::new_err(format!("{what} has shut down")))
    }

    /// Takes the value out (later `get`s fail). Returns it when no step holds it any more;
    /// otherwise the last step to end drops it, which stops its tasks.
    pub(crate) fn take(&self) -> Option<T> {
        let taken = self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
        taken.and_then(|v| Arc::try_unwrap(v).ok())
    }
}
