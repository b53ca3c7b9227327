use std::borrow::Cow;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use libp2p::kad::store::{self, RecordStore};
use libp2p::kad::{ProviderRecord, Record, RecordKey};
use libp2p::PeerId;

use crate::quota::{self, Ledger, Share, WriterUsage};
use crate::{now_ms, DhtError, DhtLimits, DhtTime, DictionaryRecord, Validator};

struct Stored {
    record: DictionaryRecord,
    /// Encoded size of `record` ([`DictionaryRecord::encoded_len`]), counted against
    /// `max_total_bytes`.
    bytes: usize,
    /// The remote peer whose PUT put each held entry there, by sub-key; local entries are absent.
    writers: HashMap<String, PeerId>,
    /// Each remote writer's share of this key, derived from `record` and `writers`.
    shares: HashMap<PeerId, Share>,
}

impl Stored {
    fn new(record: DictionaryRecord, mut writers: HashMap<String, PeerId>) -> Self {
        writers.retain(|subkey, _| record.get(subkey).is_some());
        Stored {
            bytes: record.encoded_len(),
            shares: quota::shares(&record, &writers),
            record,
            writers,
        }
    }
}

/// What [`DhtStore::insert`] did with a valid record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertOutcome {
    /// At least one entry was new or newer than what was held.
    Updated,
    /// Everything was already held with an equal or later expiration.
    Unchanged,
    /// Every entry had already expired; nothing was stored.
    NothingLive,
}

/// Counters describing a store, for status lines and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Keys held (with at least one live entry at the last sweep).
    pub records: usize,
    /// Encoded bytes held.
    pub bytes: usize,
    /// Records refused since start (invalid, forged, oversized, over quota).
    pub rejected: u64,
}

/// A bounded Kademlia record store that validates and merges dictionary records.
///
/// Bounds: never more than [`DhtLimits::max_total_bytes`] encoded bytes in all (local writes
/// included); each remote writer is charged for the entries it sent that are still held and
/// refused past its quota of bytes, keys and sub-keys per key (see [`DhtLimits`] for the limits
/// and the total bound they give, and [`DhtStore::writer_usage`]).
///
/// ```
/// use starling_dht::{DhtStore, DictionaryRecord, Entry, InsertOutcome, now_ms};
/// let mut store = DhtStore::default();
/// let mut r = DictionaryRecord::default();
/// r.insert(Entry::new("peer-a", b"x".to_vec(), now_ms() + 60_000));
/// assert_eq!(store.insert(b"group.0", &r.encode(), None, now_ms()).unwrap(), InsertOutcome::Updated);
/// let mut r2 = DictionaryRecord::default();
/// r2.insert(Entry::new("peer-b", b"y".to_vec(), now_ms() + 60_000));
/// store.insert(b"group.0", &r2.encode(), None, now_ms()).unwrap();
/// assert_eq!(store.get_live(b"group.0", now_ms()).unwrap().len(), 2); // merged, not replaced
/// ```
pub struct DhtStore {
    validator: Validator,
    records: HashMap<Vec<u8>, Stored>,
    total_bytes: usize,
    ledger: Ledger,
    rejected: u64,
}

impl Default for DhtStore {
    fn default() -> Self {
        Self::new(DhtLimits::default())
    }
}

impl DhtStore {
    /// An empty store enforcing `limits`.
    pub fn new(limits: DhtLimits) -> Self {
        DhtStore {
            validator: Validator::new(limits),
            records: HashMap::new(),
            total_bytes: 0,
            ledger: Ledger::default(),
            rejected: 0,
        }
    }

    /// The validator (and so the limits) this store applies.
    pub fn validator(&self) -> &Validator {
        &self.validator
    }

    /// Validates the raw record `value` under `key` and merges it into what is held. `writer` is
    /// the remote peer that sent it (`None` for local writes); a remote writer is charged for the
    /// entries of its record that are taken and refused with [`DhtError::OverQuota`] past the
    /// per-writer limits of [`DhtLimits`]. Every refusal counts in [`StoreStats::rejected`]. On
    /// error nothing changes.
    pub fn insert(
        &mut self,
        key: &[u8],
        value: &[u8],
        writer: Option<PeerId>,
        now: DhtTime,
    ) -> Result<InsertOutcome, DhtError> {
        let result = self.try_insert(key, value, writer, now);
        if result.is_err() {
            self.rejected += 1;
        }
        result
    }

    fn try_insert(
        &mut self,
        key: &[u8],
        value: &[u8],
        writer: Option<PeerId>,
        now: DhtTime,
    ) -> Result<InsertOutcome, DhtError> {
        let (_, incoming) = self.validator.validate(key, value, now)?;
        if incoming.is_empty() {
            return Ok(InsertOutcome::NothingLive);
        }
        let limits = self.validator.limits().clone();
        if !self.records.contains_key(key) && self.records.len() >= limits.max_records {
            self.remove_expired(now);
            if self.records.len() >= limits.max_records {
                return Err(DhtError::StoreFull("too many records"));
            }
        }
        let existing = self.records.get(key);
        let (mut merged, mut writers) = existing
            .map(|s| (s.record.clone(), s.writers.clone()))
            .unwrap_or_default();
        merged.remove_expired(now);
        let mut taken = 0;
        for entry in incoming.into_entries() {
            let subkey = entry.subkey.clone();
            if merged.insert(entry) {
                taken += 1;
                match writer {
                    Some(w) => writers.insert(subkey, w),
                    None => writers.remove(&subkey),
                };
            }
        }
        if taken == 0 && existing.is_some() {
            return Ok(InsertOutcome::Unchanged);
        }
        if merged.len() > limits.max_subkeys_per_key {
            return Err(DhtError::TooLarge {
                what: "sub-key count",
                actual: merged.len(),
                limit: limits.max_subkeys_per_key,
            });
        }
        let stored = Stored::new(merged, writers);
        if stored.bytes > limits.max_record_bytes {
            return Err(DhtError::TooLarge {
                what: "merged record",
                actual: stored.bytes,
                limit: limits.max_record_bytes,
            });
        }
        let old_bytes = existing.map_or(0, |s| s.bytes);
        if self.total_bytes - old_bytes + stored.bytes > limits.max_total_bytes {
            return Err(DhtError::StoreFull("too many bytes"));
        }
        if let Some(w) = writer {
            let old = existing.and_then(|s| s.shares.get(&w)).copied();
            let new = stored.shares.get(&w).copied();
            self.ledger
                .check(w, old.unwrap_or_default(), new.unwrap_or_default(), &limits)?;
        }
        self.replace(key, Some(stored));
        Ok(InsertOutcome::Updated)
    }

    /// Puts `new` (or nothing) under `key`, moving the byte total and every writer's charge
    /// from what was there to `new`. The one place accounting changes.
    fn replace(&mut self, key: &[u8], new: Option<Stored>) {
        let old = match new {
            Some(stored) => self.records.insert(key.to_vec(), stored),
            None => self.records.remove(key),
        };
        let none = HashMap::new();
        let new = self.records.get(key);
        self.total_bytes =
            self.total_bytes - old.as_ref().map_or(0, |s| s.bytes) + new.map_or(0, |s| s.bytes);
        self.ledger.apply(
            old.as_ref().map_or(&none, |s| &s.shares),
            new.map_or(&none, |s| &s.shares),
        );
    }

    /// The live entries under `key`, if any.
    pub fn get_live(&self, key: &[u8], now: DhtTime) -> Option<DictionaryRecord> {
        let stored = self.records.get(key)?;
        let mut record = stored.record.clone();
        record.remove_expired(now);
        (!record.is_empty()).then_some(record)
    }

    /// Drops expired entries and keys left empty, releasing their writers' quota; returns how
    /// many keys were dropped.
    pub fn remove_expired(&mut self, now: DhtTime) -> usize {
        let stale: Vec<Vec<u8>> = self
            .records
            .iter()
            .filter(|(_, s)| s.record.entries().any(|e| e.expiration <= now))
            .map(|(k, _)| k.clone())
            .collect();
        let mut dropped = 0;
        for key in stale {
            let Some(stored) = self.records.get(&key) else {
                continue;
            };
            let mut record = stored.record.clone();
            record.remove_expired(now);
            if record.is_empty() {
                self.replace(&key, None);
                dropped += 1;
            } else {
                let writers = stored.writers.clone();
                self.replace(&key, Some(Stored::new(record, writers)));
            }
        }
        dropped
    }

    /// What the remote peer `writer` holds here, as charged against its quota.
    pub fn writer_usage(&self, writer: &PeerId) -> WriterUsage {
        self.ledger.usage(writer)
    }

    /// Recomputes every total from the records themselves and checks the running ones match.
    #[cfg(test)]
    pub(crate) fn check_accounting(&self) {
        let mut total = 0;
        let mut usage: HashMap<PeerId, WriterUsage> = HashMap::new();
        for stored in self.records.values() {
            assert_eq!(stored.bytes, stored.record.encode().len());
            assert!(stored
                .writers
                .keys()
                .all(|s| stored.record.get(s).is_some()));
            total += stored.bytes;
            for (w, share) in quota::shares(&stored.record, &stored.writers) {
                assert_eq!(stored.shares.get(&w), Some(&share));
                let u = usage.entry(w).or_default();
                u.keys += 1;
                u.bytes += share.bytes;
            }
            assert_eq!(
                stored.shares.len(),
                quota::shares(&stored.record, &stored.writers).len()
            );
        }
        assert_eq!(self.total_bytes, total);
        assert_eq!(self.ledger.all(), &usage);
    }

    /// Current counters.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            records: self.records.len(),
            bytes: self.total_bytes,
            rejected: self.rejected,
        }
    }

    fn to_kad_record(key: &[u8], record: &DictionaryRecord, now: DhtTime) -> Option<Record> {
        // The latest expiration is live exactly when any entry is.
        let max = record.max_expiration().filter(|m| *m > now)?;
        Some(Record {
            key: RecordKey::new(&key),
            value: record.encode_live(now),
            publisher: None,
            expires: Some(Instant::now() + Duration::from_millis(max.saturating_sub(now))),
        })
    }
}

/// Kademlia's view of the store. Local `put`s (from our own `put_record`) go through the same
/// validation and merge as inbound ones; provider records are not supported.
impl RecordStore for DhtStore {
    type RecordsIter<'a> = std::vec::IntoIter<Cow<'a, Record>>;
    type ProvidedIter<'a> = std::iter::Empty<Cow<'a, ProviderRecord>>;

    fn get(&self, k: &RecordKey) -> Option<Cow<'_, Record>> {
        let stored = self.records.get(k.as_ref())?;
        Self::to_kad_record(k.as_ref(), &stored.record, now_ms()).map(Cow::Owned)
    }

    fn put(&mut self, r: Record) -> store::Result<()> {
        match self.insert(r.key.as_ref(), &r.value, None, now_ms()) {
            Ok(_) => Ok(()),
            Err(DhtError::StoreFull(_) | DhtError::OverQuota { .. }) => {
                Err(store::Error::MaxRecords)
            }
            Err(_) => Err(store::Error::ValueTooLarge),
        }
    }

    fn remove(&mut self, k: &RecordKey) {
        self.replace(k.as_ref(), None);
    }

    fn records(&self) -> Self::RecordsIter<'_> {
        let now = now_ms();
        self.records
            .iter()
            .filter_map(|(k, s)| Self::to_kad_record(k, &s.record, now).map(Cow::Owned))
            .collect::<Vec<_>>()
            .into_iter()
    }

    fn add_provider(&mut self, _record: ProviderRecord) -> store::Result<()> {
        Err(store::Error::MaxProvidedKeys)
    }

    fn providers(&self, _key: &RecordKey) -> Vec<ProviderRecord> {
        Vec::new()
    }

    fn provided(&self) -> Self::ProvidedIter<'_> {
        std::iter::empty()
    }

    fn remove_provider(&mut self, _k: &RecordKey, _p: &PeerId) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Entry, OwnerKey};

    const NOW: DhtTime = 1_700_000_000_000;

    fn rec(entries: &[(&str, &[u8], DhtTime)]) -> Vec<u8> {
        let mut r = DictionaryRecord::default();
        for (s, v, e) in entries {
            r.insert(Entry::new(*s, v.to_vec(), *e));
        }
        r.encode()
    }

    #[test]
    fn merges_and_latest_wins() {
        let mut s = DhtStore::default();
        s.insert(b"k", &rec(&[("a", b"1", NOW + 100)]), None, NOW)
            .unwrap();
        s.insert(b"k", &rec(&[("b", b"2", NOW + 100)]), None, NOW)
            .unwrap();
        assert_eq!(
            s.insert(b"k", &rec(&[("a", b"old", NOW + 50)]), None, NOW)
                .unwrap(),
            InsertOutcome::Unchanged
        );
        s.insert(b"k", &rec(&[("a", b"new", NOW + 200)]), None, NOW)
            .unwrap();
        let r = s.get_live(b"k", NOW).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r.get("a").unwrap().value, b"new");
    }

    #[test]
    fn expired_entries_never_returned() {
        let mut s = DhtStore::default();
        s.insert(
            b"k",
            &rec(&[("a", b"1", NOW + 10), ("b", b"2", NOW + 1000)]),
            None,
            NOW,
        )
        .unwrap();
        assert_eq!(s.get_live(b"k", NOW + 10).unwrap().len(), 1);
        assert!(s.get_live(b"k", NOW + 1000).is_none());
        assert_eq!(
            s.insert(b"x", &rec(&[("a", b"1", NOW - 1)]), None, NOW)
                .unwrap(),
            InsertOutcome::NothingLive
        );
        assert_eq!(s.remove_expired(NOW + 1000), 1);
        assert_eq!(s.stats().records, 0);
        assert_eq!(s.stats().bytes, 0);
    }

    #[test]
    fn forged_entry_rejects_whole_record_and_changes_nothing() {
        let alice = OwnerKey::from_secret_bytes(&[1; 32]);
        let mallory = OwnerKey::from_secret_bytes(&[2; 32]);
        let key = "state";
        let mut s = DhtStore::default();
        let mut good = Entry::new(alice.marker(), b"real".to_vec(), NOW + 100);
        alice.sign_entry(key, &mut good);
        let mut r = DictionaryRecord::default();
        r.insert(good);
        s.insert(key.as_bytes(), &r.encode(), None, NOW).unwrap();

        let mut forged = Entry::new(alice.marker(), b"fake".to_vec(), NOW + 500);
        mallory.sign_entry(key, &mut forged);
        let mut r = DictionaryRecord::default();
        r.insert(forged);
        r.insert(Entry::new("innocent", b"x".to_vec(), NOW + 500));
        let err = s
            .insert(key.as_bytes(), &r.encode(), None, NOW)
            .unwrap_err();
        assert!(matches!(err, DhtError::BadSignature { .. }));
        let held = s.get_live(key.as_bytes(), NOW).unwrap();
        assert_eq!(held.len(), 1);
        assert_eq!(held.get(&alice.marker()).unwrap().value, b"real");
        assert_eq!(s.stats().rejected, 1);
    }

    #[test]
    fn bounds_are_enforced() {
        let limits = DhtLimits {
            max_value_bytes: 8,
            max_subkeys_per_key: 2,
            max_records: 2,
            max_keys_per_writer: 1,
            ..DhtLimits::default()
        };
        let mut s = DhtStore::new(limits);
        assert!(s
            .insert(b"k", &rec(&[("a", &[0; 9], NOW + 10)]), None, NOW)
            .is_err());
        s.insert(
            b"k",
            &rec(&[("a", b"1", NOW + 10), ("b", b"1", NOW + 10)]),
            None,
            NOW,
        )
        .unwrap();
        assert!(s
            .insert(b"k", &rec(&[("c", b"1", NOW + 10)]), None, NOW)
            .is_err());
        let peer = PeerId::random();
        s.insert(b"k2", &rec(&[("a", b"1", NOW + 10)]), Some(peer), NOW)
            .unwrap();
        assert!(matches!(
            s.insert(b"k3", &rec(&[("a", b"1", NOW + 10)]), None, NOW),
            Err(DhtError::StoreFull(_))
        ));
        // The writer already has one key; a second key from it is refused even with room.
        s.remove(&RecordKey::new(b"k"));
        assert!(matches!(
            s.insert(b"k4", &rec(&[("a", b"1", NOW + 10)]), Some(peer), NOW),
            Err(DhtError::OverQuota { what: "keys", .. })
        ));
        let far = NOW + 48 * 3600 * 1000;
        assert!(matches!(
            s.insert(b"k5", &rec(&[("a", b"1", far)]), None, NOW),
            Err(DhtError::ExpirationTooFar { .. })
        ));
    }

    #[test]
    fn kad_view_round_trips() {
        let mut s = DhtStore::default();
        let now = now_ms();
        let key = RecordKey::new(b"k");
        s.put(Record::new(key.clone(), rec(&[("a", b"1", now + 60_000)])))
            .unwrap();
        let r = s.get(&key).unwrap();
        assert!(r.expires.is_some());
        assert_eq!(DictionaryRecord::decode(&r.value).unwrap().len(), 1);
        assert_eq!(s.records().count(), 1);
        assert!(s.put(Record::new(key, vec![1, 2, 3])).is_err());
    }
}
