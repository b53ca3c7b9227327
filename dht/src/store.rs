use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use libp2p::kad::store::{self, RecordStore};
use libp2p::kad::{ProviderRecord, Record, RecordKey};
use libp2p::PeerId;

use crate::{now_ms, DhtError, DhtLimits, DhtTime, DictionaryRecord, Validator};

struct Stored {
    record: DictionaryRecord,
    /// Encoded size of `record`, counted against `max_total_bytes`.
    bytes: usize,
    /// Remote peers that contributed entries to this key.
    writers: HashSet<PeerId>,
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
    per_writer: HashMap<PeerId, usize>,
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
            per_writer: HashMap::new(),
            rejected: 0,
        }
    }

    /// The validator (and so the limits) this store applies.
    pub fn validator(&self) -> &Validator {
        &self.validator
    }

    /// Validates the raw record `value` under `key` and merges it into what is held. `writer` is
    /// the remote peer that sent it (`None` for local writes), counted against
    /// [`DhtLimits::max_keys_per_writer`]. On error nothing changes.
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
        let mut merged = existing.map(|s| s.record.clone()).unwrap_or_default();
        merged.remove_expired(now);
        let taken = merged.merge(incoming);
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
        let bytes = merged.encode().len();
        if bytes > limits.max_record_bytes {
            return Err(DhtError::TooLarge {
                what: "merged record",
                actual: bytes,
                limit: limits.max_record_bytes,
            });
        }
        let old_bytes = existing.map_or(0, |s| s.bytes);
        if self.total_bytes - old_bytes + bytes > limits.max_total_bytes {
            return Err(DhtError::StoreFull("too many bytes"));
        }
        let new_writer = match (writer, existing) {
            (Some(w), Some(s)) => !s.writers.contains(&w),
            (Some(_), None) => true,
            (None, _) => false,
        };
        if let (true, Some(w)) = (new_writer, writer) {
            if self.per_writer.get(&w).copied().unwrap_or(0) >= limits.max_keys_per_writer {
                return Err(DhtError::StoreFull("writer has too many keys here"));
            }
            *self.per_writer.entry(w).or_default() += 1;
        }
        let stored = self.records.entry(key.to_vec()).or_insert_with(|| Stored {
            record: DictionaryRecord::default(),
            bytes: 0,
            writers: HashSet::new(),
        });
        if let (true, Some(w)) = (new_writer, writer) {
            stored.writers.insert(w);
        }
        stored.record = merged;
        stored.bytes = bytes;
        self.total_bytes = self.total_bytes - old_bytes + bytes;
        Ok(InsertOutcome::Updated)
    }

    /// The live entries under `key`, if any.
    pub fn get_live(&self, key: &[u8], now: DhtTime) -> Option<DictionaryRecord> {
        let stored = self.records.get(key)?;
        let mut record = stored.record.clone();
        record.remove_expired(now);
        (!record.is_empty()).then_some(record)
    }

    /// Drops expired entries and keys left empty; returns how many keys were dropped.
    pub fn remove_expired(&mut self, now: DhtTime) -> usize {
        let keys: Vec<Vec<u8>> = self
            .records
            .iter()
            .filter(|(_, s)| s.record.max_expiration().is_none_or(|e| e <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &keys {
            self.remove_key(k);
        }
        for stored in self.records.values_mut() {
            let before = stored.record.len();
            stored.record.remove_expired(now);
            if stored.record.len() != before {
                let bytes = stored.record.encode().len();
                self.total_bytes = self.total_bytes - stored.bytes + bytes;
                stored.bytes = bytes;
            }
        }
        keys.len()
    }

    fn remove_key(&mut self, key: &[u8]) {
        if let Some(stored) = self.records.remove(key) {
            self.total_bytes -= stored.bytes;
            for w in stored.writers {
                if let Some(n) = self.per_writer.get_mut(&w) {
                    *n -= 1;
                    if *n == 0 {
                        self.per_writer.remove(&w);
                    }
                }
            }
        }
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
        let mut live = record.clone();
        live.remove_expired(now);
        let max = live.max_expiration()?;
        Some(Record {
            key: RecordKey::new(&key),
            value: live.encode(),
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
            Err(DhtError::StoreFull(_)) => Err(store::Error::MaxRecords),
            Err(_) => Err(store::Error::ValueTooLarge),
        }
    }

    fn remove(&mut self, k: &RecordKey) {
        self.remove_key(k.as_ref());
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
            Err(DhtError::StoreFull(_))
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
