//! The crate's one policy for poisoned mutexes: recover the guard.
//!
//! Every critical section in this crate updates its data in one step (an insert, a remove, a
//! swap of a value), so a panic elsewhere while a lock was held cannot leave the data half
//! updated; refusing to go on would only turn one failed task into a dead averager.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, recovering the guard if another thread panicked while holding it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
