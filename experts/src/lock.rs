//! The crate's one policy for poisoned mutexes: recover the guard and go on.
//!
//! A `std::sync::Mutex` is poisoned when a thread panicked while holding it. Every mutex in
//! this crate guards state that stays valid between statements, so a panic elsewhere cannot
//! leave it half-written in a way that matters:
//!
//! - caches and bookkeeping of the client and the MoE layer (idle streams, DHT listings, banned
//!   replicas, last-call statistics): each update is one insert, remove or assignment, and a
//!   stale or missing entry only costs a lookup or a fresh stream;
//! - an expert's parameter map (candle's `VarMap`): only the runtime thread that owns the
//!   expert touches it, and a panic there ends that thread and the expert with it, so a poisoned
//!   map is never seen by a live owner.
//!
//! So refusing to work (or silently skipping the update, as `if let Ok(..)` did) would turn
//! one panic into a stream of errors without protecting anything. Take every lock through
//! [`lock`].

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, recovering the guard if a panicking thread poisoned it (see the module doc).
pub(crate) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_mutex_still_yields_its_value() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _guard = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
