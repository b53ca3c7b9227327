//! Per-writer quotas: what each remote writer holds in a [`crate::DhtStore`].
//!
//! Every held entry is attributed to the remote peer whose PUT put that version of it there (the
//! sender, not the owner named in a marker: owner keys cost nothing to mint, connections do).
//! Entries written by the local node are attributed to nobody. A writer is charged, per key, the
//! number of its entries and their [`Entry::encoded_len`](crate::Entry::encoded_len) — the same
//! bytes the store counts for the record, less the record's 2–3 byte header, which is charged to
//! nobody. A writer's charge moves or disappears with its entries: when another writer's newer
//! version replaces one, when one expires and is swept, when the key is removed.

use std::collections::HashMap;

use libp2p::PeerId;

use crate::{DhtError, DhtLimits, DictionaryRecord};

/// What one remote writer holds in a store (see [`crate::DhtStore::writer_usage`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriterUsage {
    /// Keys under which it holds at least one entry.
    pub keys: usize,
    /// Encoded bytes of its entries, across all keys.
    pub bytes: usize,
}

/// One writer's share of one key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Share {
    /// Entries (sub-keys) attributed to the writer.
    pub subkeys: usize,
    /// Their encoded bytes.
    pub bytes: usize,
}

/// Every writer's share of `record`, given who wrote each sub-key (`writers`; sub-keys absent
/// from it were written locally).
pub(crate) fn shares(
    record: &DictionaryRecord,
    writers: &HashMap<String, PeerId>,
) -> HashMap<PeerId, Share> {
    let mut out: HashMap<PeerId, Share> = HashMap::new();
    for entry in record.entries() {
        if let Some(w) = writers.get(&entry.subkey) {
            let share = out.entry(*w).or_default();
            share.subkeys += 1;
            share.bytes += entry.encoded_len();
        }
    }
    out
}

/// The running totals of every remote writer's usage.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    per_writer: HashMap<PeerId, WriterUsage>,
}

impl Ledger {
    /// What `writer` holds now.
    pub fn usage(&self, writer: &PeerId) -> WriterUsage {
        self.per_writer.get(writer).copied().unwrap_or_default()
    }

    /// Every remote writer holding anything.
    #[cfg(test)]
    pub fn all(&self) -> &HashMap<PeerId, WriterUsage> {
        &self.per_writer
    }

    /// Checks that `writer`'s share of one key may go from `old` to `new` under `limits`. A
    /// change that does not grow a quantity is never refused for it, so a writer over a lowered
    /// limit can still refresh or shrink what it holds.
    pub fn check(
        &self,
        writer: PeerId,
        old: Share,
        new: Share,
        limits: &DhtLimits,
    ) -> Result<(), DhtError> {
        let over = |what, actual, limit| DhtError::OverQuota {
            what,
            actual,
            limit,
        };
        if new.subkeys > old.subkeys && new.subkeys > limits.max_subkeys_per_writer_per_key {
            return Err(over(
                "sub-keys under this key",
                new.subkeys,
                limits.max_subkeys_per_writer_per_key,
            ));
        }
        let usage = self.usage(&writer);
        if old.subkeys == 0 && new.subkeys > 0 && usage.keys >= limits.max_keys_per_writer {
            return Err(over("keys", usage.keys + 1, limits.max_keys_per_writer));
        }
        let bytes = usage.bytes.saturating_sub(old.bytes) + new.bytes;
        if new.bytes > old.bytes && bytes > limits.max_bytes_per_writer {
            return Err(over("bytes", bytes, limits.max_bytes_per_writer));
        }
        Ok(())
    }

    /// Moves every writer of one key from its `old` shares to its `new` ones.
    pub fn apply(&mut self, old: &HashMap<PeerId, Share>, new: &HashMap<PeerId, Share>) {
        for (w, share) in old {
            if let Some(u) = self.per_writer.get_mut(w) {
                u.bytes = u.bytes.saturating_sub(share.bytes);
                u.keys = u.keys.saturating_sub(1);
                if u.keys == 0 {
                    self.per_writer.remove(w);
                }
            }
        }
        for (w, share) in new {
            let u = self.per_writer.entry(*w).or_default();
            u.bytes += share.bytes;
            u.keys += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Entry;

    fn limits() -> DhtLimits {
        DhtLimits {
            max_subkeys_per_writer_per_key: 2,
            max_keys_per_writer: 2,
            max_bytes_per_writer: 100,
            ..DhtLimits::default()
        }
    }

    #[test]
    fn shares_count_each_writers_entries_at_encoded_size() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let mut r = DictionaryRecord::default();
        let mut writers = HashMap::new();
        for (sub, w) in [
            ("x", Some(a)),
            ("y", Some(a)),
            ("z", Some(b)),
            ("local", None),
        ] {
            r.insert(Entry::new(sub, vec![0; 10], 1_000));
            if let Some(w) = w {
                writers.insert(sub.to_string(), w);
            }
        }
        let s = shares(&r, &writers);
        let one = Entry::new("x", vec![0; 10], 1_000).encoded_len();
        assert_eq!(
            s[&a],
            Share {
                subkeys: 2,
                bytes: 2 * one
            }
        );
        assert_eq!(
            s[&b],
            Share {
                subkeys: 1,
                bytes: one
            }
        );
        assert_eq!(s.len(), 2, "local entries are charged to nobody");
        let attributed: usize = s.values().map(|s| s.bytes).sum();
        let local = Entry::new("local", vec![0; 10], 1_000).encoded_len();
        assert_eq!(
            attributed + local + 2,
            r.encoded_len(),
            "only the header is left"
        );
    }

    #[test]
    fn check_refuses_growth_past_each_limit_only() {
        let w = PeerId::random();
        let l = limits();
        let mut ledger = Ledger::default();
        let none = Share::default();
        let share = |subkeys, bytes| Share { subkeys, bytes };
        assert!(ledger.check(w, none, share(2, 100), &l).is_ok());
        let err = ledger.check(w, none, share(3, 30), &l).unwrap_err();
        assert!(
            matches!(
                err,
                DhtError::OverQuota {
                    actual: 3,
                    limit: 2,
                    ..
                }
            ),
            "{err}"
        );
        assert!(ledger.check(w, none, share(1, 101), &l).is_err());

        ledger.apply(&HashMap::new(), &HashMap::from([(w, share(2, 60))]));
        assert_eq!(ledger.usage(&w), WriterUsage { keys: 1, bytes: 60 });
        // A second key: 60 + 40 fits, 60 + 41 does not.
        assert!(ledger.check(w, none, share(1, 40), &l).is_ok());
        assert!(ledger.check(w, none, share(1, 41), &l).is_err());
        // Replacing its own entries on the first key is charged the difference only.
        assert!(ledger.check(w, share(2, 60), share(2, 100), &l).is_ok());
        assert!(ledger.check(w, share(2, 60), share(2, 101), &l).is_err());
        ledger.apply(&HashMap::new(), &HashMap::from([(w, share(1, 40))]));
        // Third key: over the key count.
        let err = ledger.check(w, none, share(1, 0), &l).unwrap_err();
        assert!(
            matches!(err, DhtError::OverQuota { what: "keys", .. }),
            "{err}"
        );
        // Shrinking is never refused, even over a lowered limit.
        let lowered = DhtLimits {
            max_bytes_per_writer: 10,
            max_subkeys_per_writer_per_key: 1,
            ..l
        };
        assert!(ledger
            .check(w, share(2, 60), share(2, 50), &lowered)
            .is_ok());
    }

    #[test]
    fn apply_releases_and_forgets_writers_at_zero() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let mut ledger = Ledger::default();
        let s = |subkeys, bytes| Share { subkeys, bytes };
        let v1 = HashMap::from([(a, s(2, 50)), (b, s(1, 10))]);
        ledger.apply(&HashMap::new(), &v1);
        // b's entry is replaced by a newer one from a.
        let v2 = HashMap::from([(a, s(3, 62))]);
        ledger.apply(&v1, &v2);
        assert_eq!(ledger.usage(&a), WriterUsage { keys: 1, bytes: 62 });
        assert_eq!(ledger.usage(&b), WriterUsage::default());
        assert_eq!(ledger.all().len(), 1);
        ledger.apply(&v2, &HashMap::new());
        assert!(ledger.all().is_empty());
    }
}

/// The quotas as a [`crate::DhtStore`] enforces them, with the store's own accounting
/// recomputed from scratch after every step.
#[cfg(test)]
mod store_tests {
    use libp2p::kad::store::RecordStore;
    use libp2p::kad::RecordKey;
    use proptest::prelude::*;

    use crate::{DhtError, DhtLimits, DhtStore, DhtTime, DictionaryRecord, Entry, WriterUsage};
    use libp2p::PeerId;

    const NOW: DhtTime = 1_700_000_000_000;

    fn rec(entries: &[(&str, usize, DhtTime)]) -> Vec<u8> {
        let mut r = DictionaryRecord::default();
        for (s, len, e) in entries {
            r.insert(Entry::new(*s, vec![7; *len], *e));
        }
        r.encode()
    }

    fn size(subkey: &str, len: usize, expiration: DhtTime) -> usize {
        Entry::new(subkey, vec![7; len], expiration).encoded_len()
    }

    #[test]
    fn one_writer_cannot_squat_a_key() {
        let limits = DhtLimits {
            max_subkeys_per_writer_per_key: 4,
            ..DhtLimits::default()
        };
        let mut s = DhtStore::new(limits);
        let (mallory, alice) = (PeerId::random(), PeerId::random());
        let flood: Vec<String> = (0..10).map(|i| format!("junk{i}")).collect();
        let all: Vec<(&str, usize, DhtTime)> =
            flood.iter().map(|k| (k.as_str(), 1, NOW + 100)).collect();
        let err = s.insert(b"k", &rec(&all), Some(mallory), NOW).unwrap_err();
        assert!(
            matches!(
                err,
                DhtError::OverQuota {
                    what: "sub-keys under this key",
                    actual: 10,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(s.stats().records, 0, "a refused record changes nothing");
        let mut refused = 0;
        for one in &all {
            if s.insert(b"k", &rec(&[*one]), Some(mallory), NOW).is_err() {
                refused += 1;
            }
            s.check_accounting();
        }
        assert_eq!(refused, 6);
        assert_eq!(s.stats().rejected, 7);
        assert_eq!(s.get_live(b"k", NOW).unwrap().len(), 4);
        // Refreshing its own sub-keys does not grow its share and stays allowed.
        s.insert(
            b"k",
            &rec(&all[..4]
                .iter()
                .map(|(k, l, e)| (*k, *l, e + 1))
                .collect::<Vec<_>>()),
            Some(mallory),
            NOW,
        )
        .unwrap();
        // Other writers, and the local node (not quota'd), still write under the key.
        s.insert(b"k", &rec(&[("alice", 1, NOW + 100)]), Some(alice), NOW)
            .unwrap();
        let local: Vec<String> = (0..10).map(|i| format!("local{i}")).collect();
        let local: Vec<(&str, usize, DhtTime)> =
            local.iter().map(|k| (k.as_str(), 1, NOW + 100)).collect();
        s.insert(b"k", &rec(&local), None, NOW).unwrap();
        assert_eq!(s.get_live(b"k", NOW).unwrap().len(), 15);
        assert_eq!(s.writer_usage(&mallory).keys, 1);
        s.check_accounting();
    }

    #[test]
    fn byte_quota_refuses_then_is_released_on_expiry() {
        let one = size("s", 1000, NOW + 100);
        let limits = DhtLimits {
            max_bytes_per_writer: 5 * one,
            ..DhtLimits::default()
        };
        let mut s = DhtStore::new(limits);
        let (w, other) = (PeerId::random(), PeerId::random());
        let mut stored = 0;
        for i in 0..20 {
            match s.insert(
                format!("k{i}").as_bytes(),
                &rec(&[("s", 1000, NOW + 100)]),
                Some(w),
                NOW,
            ) {
                Ok(_) => stored += 1,
                Err(e) => assert!(
                    matches!(e, DhtError::OverQuota { what: "bytes", .. }),
                    "{e}"
                ),
            }
            s.check_accounting();
        }
        assert_eq!(stored, 5);
        assert_eq!(
            s.writer_usage(&w),
            WriterUsage {
                keys: 5,
                bytes: 5 * one
            }
        );
        assert_eq!(s.stats().rejected, 15);
        // The bound: entries of one writer plus a 2-byte header per key.
        assert_eq!(s.stats().bytes, 5 * (one + 2));
        // Another writer has its own quota.
        s.insert(b"other", &rec(&[("s", 1000, NOW + 500)]), Some(other), NOW)
            .unwrap();
        // Expiry releases the quota, at the sweep.
        assert_eq!(s.remove_expired(NOW + 100), 5);
        assert_eq!(s.writer_usage(&w), WriterUsage::default());
        assert_eq!(s.writer_usage(&other).keys, 1);
        s.check_accounting();
        s.insert(b"k0", &rec(&[("s", 1000, NOW + 300)]), Some(w), NOW + 100)
            .unwrap();
        assert_eq!(s.writer_usage(&w).bytes, size("s", 1000, NOW + 300));
        s.check_accounting();
    }

    #[test]
    fn expired_entries_are_released_when_their_key_is_written() {
        let mut s = DhtStore::default();
        let (a, b) = (PeerId::random(), PeerId::random());
        s.insert(
            b"k",
            &rec(&[("x", 100, NOW + 10), ("y", 5, NOW + 1000)]),
            Some(a),
            NOW,
        )
        .unwrap();
        assert_eq!(
            s.writer_usage(&a).bytes,
            size("x", 100, NOW + 10) + size("y", 5, NOW + 1000)
        );
        // At NOW + 10 "x" has expired: b's write drops it and a is charged for "y" only.
        s.insert(b"k", &rec(&[("z", 1, NOW + 1000)]), Some(b), NOW + 10)
            .unwrap();
        assert_eq!(
            s.writer_usage(&a),
            WriterUsage {
                keys: 1,
                bytes: size("y", 5, NOW + 1000)
            }
        );
        s.check_accounting();
        // A sweep that drops part of a key releases that part.
        s.insert(
            b"k2",
            &rec(&[("x", 9, NOW + 20), ("y", 9, NOW + 1000)]),
            Some(b),
            NOW,
        )
        .unwrap();
        assert_eq!(s.remove_expired(NOW + 20), 0);
        assert_eq!(
            s.writer_usage(&b),
            WriterUsage {
                keys: 2,
                bytes: size("z", 1, NOW + 1000) + size("y", 9, NOW + 1000)
            }
        );
        s.check_accounting();
    }

    #[test]
    fn replacement_moves_the_charge_to_the_new_writer() {
        let mut s = DhtStore::default();
        let (a, b) = (PeerId::random(), PeerId::random());
        s.insert(b"k", &rec(&[("x", 10, NOW + 100)]), Some(a), NOW)
            .unwrap();
        // a replaces its own entry with a larger one: charged the new size, not both.
        s.insert(b"k", &rec(&[("x", 50, NOW + 200)]), Some(a), NOW)
            .unwrap();
        assert_eq!(
            s.writer_usage(&a),
            WriterUsage {
                keys: 1,
                bytes: size("x", 50, NOW + 200)
            }
        );
        // b's newer version of the same (unsigned) sub-key replaces it: the charge moves.
        s.insert(b"k", &rec(&[("x", 20, NOW + 300)]), Some(b), NOW)
            .unwrap();
        assert_eq!(s.writer_usage(&a), WriterUsage::default());
        assert_eq!(
            s.writer_usage(&b),
            WriterUsage {
                keys: 1,
                bytes: size("x", 20, NOW + 300)
            }
        );
        // An older version from a is not taken and charges nothing.
        s.insert(b"k", &rec(&[("x", 20, NOW + 250)]), Some(a), NOW)
            .unwrap();
        assert_eq!(s.writer_usage(&a), WriterUsage::default());
        // A local write replaces it: nobody is charged; removing the key releases everything.
        s.insert(
            b"k",
            &rec(&[("x", 20, NOW + 400), ("y", 1, NOW + 400)]),
            None,
            NOW,
        )
        .unwrap();
        assert_eq!(s.writer_usage(&b), WriterUsage::default());
        s.insert(b"k", &rec(&[("z", 1, NOW + 400)]), Some(b), NOW)
            .unwrap();
        s.remove(&RecordKey::new(b"k"));
        assert_eq!(s.writer_usage(&b), WriterUsage::default());
        assert_eq!(s.stats().bytes, 0);
        s.check_accounting();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert {
            key: u8,
            writer: Option<u8>,
            entries: Vec<(u8, u16, u16)>,
        },
        Advance(u16),
        Sweep,
        Remove(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..4u8, prop::option::of(0..3u8), prop::collection::vec((0..6u8, 0..600u16, 1..400u16), 1..5))
                .prop_map(|(key, writer, entries)| Op::Insert { key, writer, entries }),
            2 => (0..200u16).prop_map(Op::Advance),
            1 => Just(Op::Sweep),
            1 => (0..4u8).prop_map(Op::Remove),
        ]
    }

    proptest! {
        /// Any sequence of writes, replacements, expiries and removals keeps the running totals
        /// equal to a recomputation, every writer within its quota, and the store within its
        /// byte bound.
        #[test]
        fn accounting_matches_recomputation(ops in prop::collection::vec(op(), 1..60)) {
            let limits = DhtLimits {
                max_subkeys_per_writer_per_key: 3,
                max_bytes_per_writer: 1500,
                max_keys_per_writer: 3,
                max_total_bytes: 4000,
                ..DhtLimits::default()
            };
            let peers: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
            let mut s = DhtStore::new(limits.clone());
            let mut now = NOW;
            for op in ops {
                match op {
                    Op::Insert { key, writer, entries } => {
                        let mut r = DictionaryRecord::default();
                        for (sub, len, ttl) in entries {
                            r.insert(Entry::new(format!("s{sub}"), vec![1; len as usize], now + u64::from(ttl)));
                        }
                        let _ = s.insert(&[b'k', key], &r.encode(), writer.map(|w| peers[w as usize]), now);
                    }
                    Op::Advance(ms) => now += u64::from(ms),
                    Op::Sweep => { s.remove_expired(now); }
                    Op::Remove(key) => s.remove(&RecordKey::new(&[b'k', key])),
                }
                s.check_accounting();
                prop_assert!(s.stats().bytes <= limits.max_total_bytes);
                for p in &peers {
                    let u = s.writer_usage(p);
                    prop_assert!(u.bytes <= limits.max_bytes_per_writer && u.keys <= limits.max_keys_per_writer);
                }
            }
        }
    }
}
