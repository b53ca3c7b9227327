//! Admission of connections that have not proven anything yet: a bound on them in all, a bound
//! per source, and room kept for sources that are expected.
//!
//! Before its token, a connection on the lane port could be anyone's. Each holds a [`Ticket`]
//! while it is unauthenticated: at most `general` tickets over all sources and `per_source`
//! per source (an IP). A source from which `k` lanes are expected (offers pending from peers
//! connected from that IP) may also hold up to `k` more, outside those bounds, and uses that
//! room first: strangers filling the general slots never lock an expected dialer out.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use starling_dht::lock::lock;

/// Which allowance a ticket was granted from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Slot {
    /// The shared allowance of every source.
    General,
    /// Room for a source from which lanes are expected.
    Expected,
}

/// How many tickets one source holds, by slot.
#[derive(Default)]
struct Held {
    general: usize,
    expected: usize,
}

/// The ticket counts; see the module docs.
pub(super) struct Gate<K> {
    general: usize,
    per_source: usize,
    in_general: usize,
    by_source: HashMap<K, Held>,
}

impl<K: Hash + Eq + Clone> Gate<K> {
    /// A gate for at most `general` tickets in all and `per_source` per source (plus the
    /// expected ones).
    pub fn new(general: usize, per_source: usize) -> Arc<Mutex<Self>> {
        Arc::new(Mutex::new(Gate {
            general,
            per_source,
            in_general: 0,
            by_source: HashMap::new(),
        }))
    }

    /// A slot for a new connection from `source`, from which `expected` lanes are awaited;
    /// `None` when it must be turned away.
    fn enter(&mut self, source: &K, expected: usize) -> Option<Slot> {
        let held = self.by_source.get(source);
        let (general, extra) = held.map_or((0, 0), |h| (h.general, h.expected));
        let slot = if extra < expected {
            Slot::Expected
        } else if general < self.per_source && self.in_general < self.general {
            Slot::General
        } else {
            return None;
        };
        let held = self.by_source.entry(source.clone()).or_default();
        match slot {
            Slot::Expected => held.expected += 1,
            Slot::General => {
                held.general += 1;
                self.in_general += 1;
            }
        }
        Some(slot)
    }

    fn leave(&mut self, source: &K, slot: Slot) {
        let Some(held) = self.by_source.get_mut(source) else {
            return;
        };
        match slot {
            Slot::Expected => held.expected = held.expected.saturating_sub(1),
            Slot::General => {
                held.general = held.general.saturating_sub(1);
                self.in_general = self.in_general.saturating_sub(1);
            }
        }
        if held.general == 0 && held.expected == 0 {
            self.by_source.remove(source);
        }
    }

    /// Sources holding tickets (for tests: entries are removed with their last ticket).
    #[cfg(test)]
    fn sources(&self) -> usize {
        self.by_source.len()
    }
}

/// One admitted connection's place; given back when dropped.
pub(super) struct Ticket<K: Hash + Eq + Clone> {
    gate: Arc<Mutex<Gate<K>>>,
    source: K,
    slot: Slot,
}

impl<K: Hash + Eq + Clone> Ticket<K> {
    /// A ticket for a connection from `source` (see [`Gate`]), or `None`.
    pub fn take(gate: &Arc<Mutex<Gate<K>>>, source: K, expected: usize) -> Option<Self> {
        let slot = lock(gate).enter(&source, expected)?;
        Some(Ticket {
            gate: gate.clone(),
            source,
            slot,
        })
    }

    /// The allowance this ticket came from.
    #[cfg(test)]
    pub fn slot(&self) -> Slot {
        self.slot
    }
}

impl<K: Hash + Eq + Clone> Drop for Ticket<K> {
    fn drop(&mut self) {
        lock(&self.gate).leave(&self.source, self.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_source_is_capped_and_all_together_too() {
        let gate = Gate::new(5, 2);
        let a: Vec<_> = (0..3).filter_map(|_| Ticket::take(&gate, 'a', 0)).collect();
        assert_eq!(a.len(), 2, "per-source cap");
        let b: Vec<_> = (0..3).filter_map(|_| Ticket::take(&gate, 'b', 0)).collect();
        assert_eq!(b.len(), 2);
        assert!(Ticket::take(&gate, 'c', 0).is_some_and(|t| t.slot() == Slot::General));
        // Five in all: a fourth source is turned away.
        let held = Ticket::take(&gate, 'c', 0);
        assert!(held.is_some());
        assert!(Ticket::take(&gate, 'd', 0).is_none());
        drop(held);
        assert!(Ticket::take(&gate, 'd', 0).is_some(), "places come back");
        drop(a);
        drop(b);
        assert_eq!(lock(&gate).sources(), 0, "no entry outlives its tickets");
    }

    #[test]
    fn sources_with_pending_offers_get_in_when_strangers_fill_every_place() {
        let gate = Gate::new(4, 2);
        // Strangers from two addresses take every general place.
        let strangers: Vec<_> = ['x', 'x', 'y', 'y']
            .into_iter()
            .filter_map(|s| Ticket::take(&gate, s, 0))
            .collect();
        assert_eq!(strangers.len(), 4);
        assert!(Ticket::take(&gate, 'm', 0).is_none());
        // A member with three offers pending gets three places, no more.
        let member: Vec<_> = (0..4).filter_map(|_| Ticket::take(&gate, 'm', 3)).collect();
        assert_eq!(member.len(), 3);
        assert!(member.iter().all(|t| t.slot() == Slot::Expected));
        // A stranger sharing nothing with pending offers stays out.
        assert!(Ticket::take(&gate, 'x', 0).is_none());
        drop(member);
        drop(strangers);
        assert_eq!(lock(&gate).sources(), 0);
    }
}
