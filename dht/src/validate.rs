use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::lock::lock;
use crate::{owner::verify_entry, DhtError, DhtTime, DictionaryRecord};

/// Bounds on what a peer accepts and holds. Every field is a hard limit checked before a record
/// is stored; the defaults suit matchmaking and expert declarations.
///
/// The per-writer limits (`max_keys_per_writer`, `max_bytes_per_writer`,
/// `max_subkeys_per_writer_per_key`) apply to remote writers, each charged for the entries it
/// sent that are still held (see [`crate::DhtStore`]); the local node's own writes are bounded
/// only by the store-wide limits.
///
/// **Total bound.** A store never holds more than `max_total_bytes` encoded bytes, local writes
/// included: every insert that would pass it is refused. Within that, `W` remote writers hold at
/// most `W * max_bytes_per_writer` bytes of entries (plus a record header of 1 + varint(count)
/// bytes per key, at most `max_keys_per_writer` keys each), so filling a store with the defaults
/// takes at least 32 distinct peers, and one writer never holds more than
/// `max_subkeys_per_writer_per_key` of a key's `max_subkeys_per_key` sub-keys.
#[derive(Debug, Clone)]
pub struct DhtLimits {
    /// Longest key, in bytes.
    pub max_key_bytes: usize,
    /// Longest sub-key, in bytes.
    pub max_subkey_bytes: usize,
    /// Largest value of one entry, in bytes.
    pub max_value_bytes: usize,
    /// Most sub-keys held under one key.
    pub max_subkeys_per_key: usize,
    /// Largest encoded record (all entries of a key), in bytes. Kademlia's packet size is set
    /// above this so a full record always fits one message.
    pub max_record_bytes: usize,
    /// Most keys held by one store.
    pub max_records: usize,
    /// Most bytes (encoded records) held by one store.
    pub max_total_bytes: usize,
    /// Most keys under which one remote writer may hold entries.
    pub max_keys_per_writer: usize,
    /// Most bytes one remote writer may hold across the store, in encoded bytes of its entries
    /// ([`crate::Entry::encoded_len`], the bytes they add to their records). At least
    /// `max_record_bytes`, so one writer can always fill one record.
    pub max_bytes_per_writer: usize,
    /// Most sub-keys one remote writer may hold under a single key, so no writer can squat a
    /// key's `max_subkeys_per_key` slots. Owner-signed entries count too (owner keys are free
    /// to mint). An expert server declares one sub-key per expert of a grid row under that
    /// row's prefix key, so this also caps how many experts of one row a server can host.
    pub max_subkeys_per_writer_per_key: usize,
    /// Longest accepted time-to-live: entries expiring later than `now + max_ttl + clock_skew`
    /// are refused.
    pub max_ttl: Duration,
    /// Tolerated difference between peers' wall clocks.
    pub clock_skew: Duration,
}

impl Default for DhtLimits {
    fn default() -> Self {
        DhtLimits {
            max_key_bytes: 512,
            max_subkey_bytes: 512,
            max_value_bytes: 16 * 1024,
            max_subkeys_per_key: 1024,
            max_record_bytes: 256 * 1024,
            max_records: 16 * 1024,
            max_total_bytes: 256 * 1024 * 1024,
            max_keys_per_writer: 4096,
            // 1/32 of the store: 32 records of the largest size, thousands of declarations.
            max_bytes_per_writer: 8 * 1024 * 1024,
            // 1/8 of a key: honest writers put one sub-key per key (matchmaking, progress) or
            // one per hosted expert of a grid row.
            max_subkeys_per_writer_per_key: 128,
            max_ttl: Duration::from_secs(24 * 3600),
            clock_skew: Duration::from_secs(30),
        }
    }
}

/// Checks inbound records against [`DhtLimits`] and owner signatures.
///
/// ```
/// use starling_dht::{DictionaryRecord, Entry, Validator, now_ms};
/// let v = Validator::default();
/// let mut r = DictionaryRecord::default();
/// r.insert(Entry::new("sub", vec![1, 2, 3], now_ms() + 10_000));
/// let (key, rec) = v.validate(b"some.key", &r.encode(), now_ms()).unwrap();
/// assert_eq!(key, "some.key");
/// assert_eq!(rec.len(), 1);
/// assert!(v.validate(b"some.key", &[0xde, 0xad], now_ms()).is_err());
/// ```
#[derive(Debug, Clone, Default)]
pub struct Validator {
    limits: DhtLimits,
    /// Entries whose signature checked out (shared by clones).
    verified: Arc<Mutex<Verified>>,
}

/// Digests of entries already verified, oldest forgotten first. A lookup brings back the same
/// signed entries from every peer that holds the record, and matchmaking reads a key several
/// times a second: verifying each once (about 50 us each for ed25519, against about 1 us for
/// the digest) keeps 64 peers reading a 64-entry key from spending their CPU on signatures.
#[derive(Debug, Default)]
struct Verified {
    known: HashSet<[u8; 32]>,
    order: VecDeque<[u8; 32]>,
}

/// Verified entries remembered (32 bytes each, about 0.5 MiB with overhead).
const VERIFIED_CAPACITY: usize = 8192;

impl Verified {
    fn contains(&self, digest: &[u8; 32]) -> bool {
        self.known.contains(digest)
    }

    fn insert(&mut self, digest: [u8; 32]) {
        if self.known.insert(digest) {
            self.order.push_back(digest);
            while self.order.len() > VERIFIED_CAPACITY {
                if let Some(old) = self.order.pop_front() {
                    self.known.remove(&old);
                }
            }
        }
    }
}

/// SHA-256 over everything a signature covers and the signature itself, each part
/// length-prefixed: equal digests mean the same key, sub-key (and so owner), value,
/// expiration and signature.
fn entry_digest(key: &str, entry: &crate::Entry) -> [u8; 32] {
    let mut h = Sha256::new();
    let sig: &[u8] = entry.signature.as_deref().unwrap_or(&[]);
    for part in [key.as_bytes(), entry.subkey.as_bytes(), &entry.value, sig] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.update(entry.expiration.to_le_bytes());
    h.finalize().into()
}

fn check(what: &'static str, actual: usize, limit: usize) -> Result<(), DhtError> {
    if actual > limit {
        Err(DhtError::TooLarge {
            what,
            actual,
            limit,
        })
    } else {
        Ok(())
    }
}

impl Validator {
    /// A validator enforcing `limits`.
    pub fn new(limits: DhtLimits) -> Self {
        Validator {
            limits,
            verified: Arc::default(),
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> &DhtLimits {
        &self.limits
    }

    /// Checks a key on its own (length, UTF-8, owner marker syntax).
    pub fn validate_key<'a>(&self, key: &'a [u8]) -> Result<&'a str, DhtError> {
        check("key", key.len(), self.limits.max_key_bytes)?;
        let key = std::str::from_utf8(key).map_err(|_| DhtError::KeyNotUtf8)?;
        crate::required_owner(key, "")?;
        Ok(key)
    }

    /// Validates a raw record (as it arrives from Kademlia) and returns its key and its live
    /// entries. Any invalid entry (oversized, unsigned or forged, too far in the future) rejects
    /// the whole record; entries that have already expired are dropped silently.
    pub fn validate(
        &self,
        key: &[u8],
        value: &[u8],
        now: DhtTime,
    ) -> Result<(String, DictionaryRecord), DhtError> {
        let key = self.validate_key(key)?;
        check("record", value.len(), self.limits.max_record_bytes)?;
        let record = DictionaryRecord::decode(value)?;
        check(
            "sub-key count",
            record.len(),
            self.limits.max_subkeys_per_key,
        )?;
        let horizon = self.horizon(now);
        for entry in record.entries() {
            check("sub-key", entry.subkey.len(), self.limits.max_subkey_bytes)?;
            check("value", entry.value.len(), self.limits.max_value_bytes)?;
            if entry.expiration > horizon {
                return Err(DhtError::ExpirationTooFar {
                    expiration_ms: entry.expiration,
                    horizon_ms: horizon,
                });
            }
            self.verify_once(key, entry)?;
        }
        let mut record = record;
        record.remove_expired(now);
        Ok((key.to_string(), record))
    }

    /// [`verify_entry`], skipped for an entry verified before (by its digest).
    fn verify_once(&self, key: &str, entry: &crate::Entry) -> Result<(), DhtError> {
        let digest = entry_digest(key, entry);
        if lock(&self.verified).contains(&digest) {
            return Ok(());
        }
        verify_entry(key, entry)?;
        lock(&self.verified).insert(digest);
        Ok(())
    }

    /// The latest expiration accepted at `now`.
    pub fn horizon(&self, now: DhtTime) -> DhtTime {
        now.saturating_add((self.limits.max_ttl + self.limits.clock_skew).as_millis() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{now_ms, Entry, OwnerKey};

    /// A validator that verified an entry still refuses every alteration of it (the remembered
    /// digest covers key, sub-key, value, expiration and signature), and forgets the oldest
    /// entries beyond its capacity.
    #[test]
    fn verified_entries_are_remembered_exactly() {
        let alice = OwnerKey::from_secret_bytes(&[1; 32]);
        let mallory = OwnerKey::from_secret_bytes(&[2; 32]);
        let v = Validator::default();
        let k = "group.key";
        let exp = now_ms() + 60_000;
        let mut e = Entry::new(alice.marker(), b"v".to_vec(), exp);
        alice.sign_entry(k, &mut e);
        let record = |e: &Entry| {
            let mut r = DictionaryRecord::default();
            r.insert(e.clone());
            r.encode()
        };
        for _ in 0..2 {
            assert!(v.validate(k.as_bytes(), &record(&e), now_ms()).is_ok());
        }
        let mut value = e.clone();
        value.value = b"w".to_vec();
        let mut later = e.clone();
        later.expiration += 1;
        let mut resigned = e.clone();
        mallory.sign_entry(k, &mut resigned);
        let mut unsigned = e.clone();
        unsigned.signature = None;
        for (what, forged) in [
            ("value", value),
            ("expiration", later),
            ("signer", resigned),
            ("no signature", unsigned),
        ] {
            assert!(
                v.validate(k.as_bytes(), &record(&forged), now_ms())
                    .is_err(),
                "altered {what} accepted"
            );
        }
        assert!(v.validate(b"other.key", &record(&e), now_ms()).is_err());
        let mut cache = Verified::default();
        for i in 0..VERIFIED_CAPACITY + 10 {
            let mut d = [0u8; 32];
            d[..8].copy_from_slice(&(i as u64).to_le_bytes());
            cache.insert(d);
        }
        assert_eq!(cache.known.len(), VERIFIED_CAPACITY);
        assert!(!cache.contains(&[0; 32]), "the oldest was forgotten");
    }
}
