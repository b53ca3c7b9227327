use std::collections::BTreeMap;

use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::{DhtError, DhtTime};

/// Version byte that starts every encoded [`DictionaryRecord`]; bumped on incompatible changes.
pub const RECORD_FORMAT_VERSION: u8 = 1;

/// One value under a sub-key, with its expiration and, for owner-protected entries, a signature.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The sub-key (may be empty for single-valued keys).
    pub subkey: String,
    /// The opaque value; see [`encode_value`] for typed values. (De)serialized as one byte
    /// string (`serde_bytes`): postcard writes it exactly as a sequence of `u8` (varint
    /// length, then the bytes), so the wire format is unchanged, but a record of 64
    /// declarations decodes in one copy per field instead of a call per byte.
    #[serde(with = "serde_bytes")]
    pub value: Vec<u8>,
    /// When the entry expires, in unix milliseconds.
    pub expiration: DhtTime,
    /// Ed25519 signature (64 bytes) by the owner named in the key or sub-key, if any.
    #[serde(with = "serde_bytes")]
    pub signature: Option<Vec<u8>>,
}

impl Entry {
    /// An unsigned entry.
    pub fn new(subkey: impl Into<String>, value: Vec<u8>, expiration: DhtTime) -> Self {
        Entry {
            subkey: subkey.into(),
            value,
            expiration,
            signature: None,
        }
    }

    /// The entry's encoded size in bytes: exactly what it adds to [`DictionaryRecord::encode`]'s
    /// output (postcard: length-prefixed sub-key and value, varint expiration, optional
    /// length-prefixed signature). Stores charge writers this size.
    pub fn encoded_len(&self) -> usize {
        let bytes = |n: usize| varint_len(n as u64) + n;
        bytes(self.subkey.len())
            + bytes(self.value.len())
            + varint_len(self.expiration)
            + 1
            + self.signature.as_ref().map_or(0, |s| bytes(s.len()))
    }

    /// Total ordering used when two entries for one sub-key meet: the later expiration wins; on a
    /// tie the larger (value, signature) wins, so every replica picks the same one.
    fn beats(&self, other: &Entry) -> bool {
        (self.expiration, &self.value, &self.signature)
            > (other.expiration, &other.value, &other.signature)
    }
}

/// Bytes of `x` as a postcard varint (7 bits per byte).
fn varint_len(x: u64) -> usize {
    (64 - x.leading_zeros() as usize).div_ceil(7).max(1)
}

/// An encoded record: read as `Wire<Entry>`, written as `Wire<&Entry>` (the entries borrowed,
/// not cloned; the same encoding).
#[derive(Serialize, Deserialize)]
struct Wire<E> {
    version: u8,
    entries: Vec<E>,
}

/// The value held under one DHT key: a dictionary `subkey -> Entry`.
///
/// ```
/// use starling_dht::{DictionaryRecord, Entry};
/// let mut r = DictionaryRecord::default();
/// r.insert(Entry::new("a", vec![1], 2_000));
/// r.insert(Entry::new("b", vec![2], 500));
/// assert_eq!(r.live_entries(1_000).count(), 1); // "b" has expired at t = 1000 ms
/// let bytes = r.encode();
/// assert_eq!(DictionaryRecord::decode(&bytes).unwrap(), r);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DictionaryRecord {
    entries: BTreeMap<String, Entry>,
}

impl DictionaryRecord {
    /// Inserts an entry, keeping the existing one if it wins the merge rule. Returns whether the
    /// new entry was kept.
    pub fn insert(&mut self, entry: Entry) -> bool {
        match self.entries.get(&entry.subkey) {
            Some(old) if !entry.beats(old) => false,
            _ => {
                self.entries.insert(entry.subkey.clone(), entry);
                true
            }
        }
    }

    /// Merges `other` into `self`: per sub-key, the latest expiration wins. Returns how many
    /// entries of `other` were taken.
    pub fn merge(&mut self, other: DictionaryRecord) -> usize {
        other
            .entries
            .into_values()
            .map(|e| self.insert(e) as usize)
            .sum()
    }

    /// The entry under `subkey`, whether or not it has expired.
    pub fn get(&self, subkey: &str) -> Option<&Entry> {
        self.entries.get(subkey)
    }

    /// Entries that have not expired at `now` (unix ms).
    pub fn live_entries(&self, now: DhtTime) -> impl Iterator<Item = &Entry> {
        self.entries.values().filter(move |e| e.expiration > now)
    }

    /// All entries, expired or not.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }

    /// Drops entries that have expired at `now`.
    pub fn remove_expired(&mut self, now: DhtTime) {
        self.entries.retain(|_, e| e.expiration > now);
    }

    /// Number of entries (expired ones included until [`Self::remove_expired`]).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The latest expiration of any entry.
    pub fn max_expiration(&self) -> Option<DhtTime> {
        self.entries.values().map(|e| e.expiration).max()
    }

    /// The length of [`Self::encode`]'s output, computed without encoding: a version byte, the
    /// entry count as a varint, and every entry's [`Entry::encoded_len`].
    pub fn encoded_len(&self) -> usize {
        1 + varint_len(self.entries.len() as u64)
            + self.entries.values().map(Entry::encoded_len).sum::<usize>()
    }

    /// Consumes the record, yielding its entries in sub-key order.
    pub(crate) fn into_entries(self) -> impl Iterator<Item = Entry> {
        self.entries.into_values()
    }

    /// Encodes the record for the wire (postcard, prefixed by [`RECORD_FORMAT_VERSION`]).
    pub fn encode(&self) -> Vec<u8> {
        Self::encode_entries(self.entries.values())
    }

    /// Encodes only the entries live at `now` (unix ms): what [`Self::encode`] gives after
    /// [`Self::remove_expired`]`(now)`, without copying the record. A store answers lookups
    /// with it.
    ///
    /// ```
    /// use starling_dht::{DictionaryRecord, Entry};
    /// let mut r = DictionaryRecord::default();
    /// r.insert(Entry::new("a", vec![1], 2_000));
    /// r.insert(Entry::new("b", vec![2], 500));
    /// let live = DictionaryRecord::decode(&r.encode_live(1_000)).unwrap();
    /// assert_eq!(live.len(), 1);
    /// ```
    pub fn encode_live(&self, now: DhtTime) -> Vec<u8> {
        Self::encode_entries(self.live_entries(now))
    }

    fn encode_entries<'a>(entries: impl Iterator<Item = &'a Entry>) -> Vec<u8> {
        let wire = Wire {
            version: RECORD_FORMAT_VERSION,
            entries: entries.collect(),
        };
        // Serializing plain structs of strings, byte vectors and integers into a Vec cannot fail.
        postcard::to_stdvec(&wire).unwrap_or_default()
    }

    /// Decodes wire bytes. Duplicate sub-keys are merged by the usual rule. The caller bounds the
    /// input size (see [`crate::Validator`]); decoding never allocates more than the input implies.
    pub fn decode(bytes: &[u8]) -> Result<Self, DhtError> {
        let wire: Wire<Entry> =
            postcard::from_bytes(bytes).map_err(|e| DhtError::Malformed(e.to_string()))?;
        if wire.version != RECORD_FORMAT_VERSION {
            return Err(DhtError::UnsupportedVersion(wire.version));
        }
        let mut record = DictionaryRecord::default();
        for e in wire.entries {
            record.insert(e);
        }
        Ok(record)
    }

    /// Decodes every live entry's value as `T`, returning `(subkey, value, expiration)`; entries
    /// that do not decode as `T` are skipped.
    pub fn typed_entries<T: DeserializeOwned>(&self, now: DhtTime) -> Vec<(String, T, DhtTime)> {
        self.live_entries(now)
            .filter_map(|e| {
                decode_value::<T>(&e.value)
                    .ok()
                    .map(|v| (e.subkey.clone(), v, e.expiration))
            })
            .collect()
    }
}

/// Encodes a typed value for storage (postcard).
///
/// ```
/// let bytes = starling_dht::encode_value(&(1u32, "x".to_string())).unwrap();
/// let back: (u32, String) = starling_dht::decode_value(&bytes).unwrap();
/// assert_eq!(back, (1, "x".to_string()));
/// ```
pub fn encode_value<T: Serialize>(value: &T) -> Result<Vec<u8>, DhtError> {
    postcard::to_stdvec(value).map_err(|e| DhtError::Codec(e.to_string()))
}

/// Decodes a typed value stored with [`encode_value`].
pub fn decode_value<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, DhtError> {
    postcard::from_bytes(bytes).map_err(|e| DhtError::Codec(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latest_expiration_wins_both_orders() {
        let old = Entry::new("k", b"old".to_vec(), 100);
        let new = Entry::new("k", b"new".to_vec(), 200);
        let mut a = DictionaryRecord::default();
        a.insert(old.clone());
        a.insert(new.clone());
        let mut b = DictionaryRecord::default();
        b.insert(new.clone());
        b.insert(old);
        assert_eq!(a, b);
        assert_eq!(a.get("k").unwrap().value, b"new");
    }

    #[test]
    fn merge_is_commutative_and_keeps_all_subkeys() {
        let mut a = DictionaryRecord::default();
        a.insert(Entry::new("x", b"1".to_vec(), 100));
        a.insert(Entry::new("y", b"1".to_vec(), 300));
        let mut b = DictionaryRecord::default();
        b.insert(Entry::new("x", b"2".to_vec(), 200));
        b.insert(Entry::new("z", b"2".to_vec(), 100));
        let mut ab = a.clone();
        ab.merge(b.clone());
        let mut ba = b;
        ba.merge(a);
        assert_eq!(ab, ba);
        assert_eq!(ab.len(), 3);
        assert_eq!(ab.get("x").unwrap().value, b"2");
        assert_eq!(ab.get("y").unwrap().value, b"1");
    }

    #[test]
    fn tie_break_is_deterministic() {
        let mut a = DictionaryRecord::default();
        a.insert(Entry::new("k", b"a".to_vec(), 100));
        a.insert(Entry::new("k", b"b".to_vec(), 100));
        let mut b = DictionaryRecord::default();
        b.insert(Entry::new("k", b"b".to_vec(), 100));
        b.insert(Entry::new("k", b"a".to_vec(), 100));
        assert_eq!(a, b);
    }

    #[test]
    fn expired_entries_are_not_live() {
        let mut r = DictionaryRecord::default();
        r.insert(Entry::new("a", vec![], 1000));
        r.insert(Entry::new("b", vec![], 999));
        let live: Vec<_> = r.live_entries(999).map(|e| e.subkey.clone()).collect();
        assert_eq!(live, vec!["a".to_string()]);
        assert_eq!(r.live_entries(1000).count(), 0);
        r.remove_expired(999);
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn decode_rejects_garbage_and_versions() {
        assert!(DictionaryRecord::decode(&[]).is_err());
        assert!(matches!(
            DictionaryRecord::decode(&[9, 0]),
            Err(DhtError::UnsupportedVersion(9))
        ));
        // A huge claimed length must not allocate or panic.
        assert!(DictionaryRecord::decode(&[1, 0xff, 0xff, 0xff, 0xff, 0x0f]).is_err());
    }

    #[test]
    fn encoded_len_matches_encoding() {
        assert_eq!(DictionaryRecord::default().encoded_len(), 2);
        let mut r = DictionaryRecord::default();
        for (i, (sub_len, value_len, expiration)) in [
            (0, 0, 0u64),
            (1, 127, 127),
            (127, 128, 128),
            (128, 16_383, u64::MAX),
            (300, 16_384, 1_700_000_000_000),
            (5, 70_000, 1 << 35),
        ]
        .into_iter()
        .enumerate()
        {
            let mut e = Entry::new(
                "s".repeat(sub_len) + &i.to_string(),
                vec![7; value_len],
                expiration,
            );
            assert_eq!(e.encoded_len(), postcard::to_stdvec(&e).unwrap().len());
            if i % 2 == 1 {
                e.signature = Some(vec![1; 64]);
                assert_eq!(e.encoded_len(), postcard::to_stdvec(&e).unwrap().len());
            }
            r.insert(e);
            assert_eq!(r.encoded_len(), r.encode().len());
        }
        for i in 0..200 {
            r.insert(Entry::new(format!("k{i}"), vec![], 1));
        }
        assert_eq!(r.encoded_len(), r.encode().len());
    }

    /// The encoding as it was before `serde_bytes` (byte vectors as sequences of `u8`): the
    /// bytes on the wire must not change, so that peers of both builds read each other.
    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct PlainEntry {
        subkey: String,
        value: Vec<u8>,
        expiration: DhtTime,
        signature: Option<Vec<u8>>,
    }

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct PlainWire {
        version: u8,
        entries: Vec<PlainEntry>,
    }

    #[test]
    fn the_wire_format_is_the_plain_one_both_ways() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for round in 0..50 {
            let mut r = DictionaryRecord::default();
            for i in 0..rng.gen_range(0..40) {
                let len = [0, 1, 127, 128, 300, 16_384][rng.gen_range(0..6)];
                let mut e = Entry::new(
                    format!("k{round}.{i}"),
                    (0..len).map(|_| rng.gen()).collect(),
                    rng.gen_range(0..1u64 << 45),
                );
                if rng.gen_bool(0.5) {
                    e.signature = Some((0..64).map(|_| rng.gen()).collect());
                }
                r.insert(e);
            }
            let plain = PlainWire {
                version: RECORD_FORMAT_VERSION,
                entries: r
                    .entries()
                    .map(|e| PlainEntry {
                        subkey: e.subkey.clone(),
                        value: e.value.clone(),
                        expiration: e.expiration,
                        signature: e.signature.clone(),
                    })
                    .collect(),
            };
            let bytes = postcard::to_stdvec(&plain).unwrap();
            assert_eq!(r.encode(), bytes, "round {round}");
            assert_eq!(DictionaryRecord::decode(&bytes).unwrap(), r);
            let back: PlainWire = postcard::from_bytes(&r.encode()).unwrap();
            assert_eq!(back, plain);
            let now = rng.gen_range(0..1u64 << 45);
            let mut live = r.clone();
            live.remove_expired(now);
            assert_eq!(r.encode_live(now), live.encode());
        }
    }

    #[test]
    fn typed_entries_skip_undecodable() {
        let mut r = DictionaryRecord::default();
        r.insert(Entry::new("a", encode_value(&7u64).unwrap(), 10));
        r.insert(Entry::new("b", vec![0xff, 0xff, 0xff], 10));
        let got: Vec<(String, u64, u64)> = r.typed_entries(0);
        assert_eq!(got, vec![("a".to_string(), 7, 10)]);
    }
}
