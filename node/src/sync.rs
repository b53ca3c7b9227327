//! Locks, and node's one policy for poisoned ones.
//!
//! A `std::sync::Mutex` is poisoned when a thread panics while holding it. Every critical
//! section in this crate is one short operation on a map or a vector (an insert, a remove, a
//! `retain`, a `drain`) that never leaves the data half-updated, so a poisoned lock still guards
//! consistent data: [`lock`] recovers the guard instead of failing or skipping the operation.
//! Guards are never held across an `.await` (the swarm task owns everything else).

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, recovering the guard if another thread panicked while holding it (see the
/// module docs for why that is safe here).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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
