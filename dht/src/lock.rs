//! The workspace's one policy for poisoned mutexes: recover the guard and go on.
//!
//! A `std::sync::Mutex` is poisoned when a thread panics while holding it. Every critical
//! section in Starling is one short operation on a map, a vector or a value (an insert, a remove,
//! a `retain`, a `drain`, an assignment) that never leaves the data half-updated, and no guard is
//! held across an `.await`. So a poisoned lock still guards consistent data, and refusing to go
//! on (or silently skipping the update, as `if let Ok(..)` would) would only turn one panic into
//! a stream of errors, a dead averager or a dead expert, without protecting anything.
//!
//! Every crate takes its locks through [`lock`] (`starling_node::lock` re-exports this module
//! for the crates above the node).
//!
//! ```
//! use std::sync::Mutex;
//! let m = Mutex::new(vec![1]);
//! starling_dht::lock::lock(&m).push(2);
//! assert_eq!(*starling_dht::lock::lock(&m), vec![1, 2]);
//! ```

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, recovering the guard if another thread panicked while holding it (see the
/// module docs for why that is safe here).
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_still_gives_its_data() {
        let m = Mutex::new(vec![1]);
        let _ = std::thread::scope(|s| {
            s.spawn(|| {
                let _g = m.lock().unwrap();
                panic!("poison the lock");
            })
            .join()
        });
        assert!(m.is_poisoned());
        lock(&m).push(2);
        assert_eq!(*lock(&m), vec![1, 2]);
    }
}
