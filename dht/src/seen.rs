//! Signatures this process has already checked or made, and owner keys it has already parsed,
//! so that each is paid for once.
//!
//! One entry travels through a process several times: a peer signs its progress report, checks
//! it before sending (for the caller's precise error), stores it locally (checked again), and
//! reads it back with every lookup of its key, beside the other peers' entries it checked when
//! they stored them. Two peers training a small MLP spent about 2.6% of their CPU on ed25519,
//! three quarters of it checking signatures they had checked (or made) before.
//!
//! A check is remembered by a BLAKE3 digest of everything it covered (the owner's public key,
//! the signature and the signed message): only that exact triple is ever taken as valid without
//! the curve arithmetic. Both tables are bounded ([`SIGNATURES`], [`OWNERS`]); the oldest
//! entries go first.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use ed25519_dalek::VerifyingKey;

/// Checked signatures remembered (32 bytes each, about 200 KiB in all with the index).
pub(crate) const SIGNATURES: usize = 4096;
/// Parsed owner keys remembered.
pub(crate) const OWNERS: usize = 1024;

/// A bounded map that forgets its oldest members.
struct Bounded<K, V> {
    map: HashMap<K, V>,
    order: VecDeque<K>,
    cap: usize,
}

impl<K: std::hash::Hash + Eq + Copy, V: Copy> Bounded<K, V> {
    fn new(cap: usize) -> Self {
        Bounded {
            map: HashMap::new(),
            order: VecDeque::new(),
            cap,
        }
    }

    fn get(&self, k: &K) -> Option<V> {
        self.map.get(k).copied()
    }

    fn insert(&mut self, k: K, v: V) {
        if self.map.contains_key(&k) {
            return;
        }
        self.map.insert(k, v);
        self.order.push_back(k);
        while self.order.len() > self.cap {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

static SIGNED: Mutex<Option<Bounded<[u8; 32], ()>>> = Mutex::new(None);
static PARSED: Mutex<Option<Bounded<[u8; 32], VerifyingKey>>> = Mutex::new(None);

/// The digest a check of `signature` by `owner` over `message` is remembered by.
pub(crate) fn digest(owner: &VerifyingKey, signature: &[u8; 64], message: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_derive_key("starling-dht checked signature v1");
    h.update(owner.as_bytes());
    h.update(signature);
    h.update(message);
    *h.finalize().as_bytes()
}

/// Whether a signature with this digest was checked (or made) by this process.
pub(crate) fn checked(d: &[u8; 32]) -> bool {
    let seen = crate::lock::lock(&SIGNED);
    seen.as_ref().is_some_and(|s| s.get(d).is_some())
}

/// Remembers a signature that verified (or that this process made).
pub(crate) fn remember(d: [u8; 32]) {
    crate::lock::lock(&SIGNED)
        .get_or_insert_with(|| Bounded::new(SIGNATURES))
        .insert(d, ());
}

/// The owner key with these bytes, parsed (a point decompression) only the first time.
pub(crate) fn owner_key(bytes: &[u8; 32]) -> Result<VerifyingKey, ed25519_dalek::SignatureError> {
    if let Some(k) = crate::lock::lock(&PARSED)
        .as_ref()
        .and_then(|p| p.get(bytes))
    {
        return Ok(k);
    }
    let key = VerifyingKey::from_bytes(bytes)?;
    crate::lock::lock(&PARSED)
        .get_or_insert_with(|| Bounded::new(OWNERS))
        .insert(*bytes, key);
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_members_go_first_and_the_bound_holds() {
        let mut b = Bounded::new(3);
        for k in 0u32..5 {
            b.insert(k, k * 10);
        }
        b.insert(4, 0); // already there: no new slot, the first value stays
        assert!(b.get(&0).is_none() && b.get(&1).is_none());
        assert_eq!(
            (b.get(&2), b.get(&3), b.get(&4)),
            (Some(20), Some(30), Some(40))
        );
        assert_eq!((b.map.len(), b.order.len()), (3, 3));
    }

    #[test]
    fn a_digest_covers_the_owner_the_signature_and_the_message() {
        let a = crate::OwnerKey::from_secret_bytes(&[1; 32]).public();
        let b = crate::OwnerKey::from_secret_bytes(&[2; 32]).public();
        let sig = [9u8; 64];
        let mut other_sig = sig;
        other_sig[63] ^= 1;
        let d = digest(&a, &sig, b"m");
        assert_ne!(d, digest(&b, &sig, b"m"));
        assert_ne!(d, digest(&a, &other_sig, b"m"));
        assert_ne!(d, digest(&a, &sig, b"n"));
        assert_eq!(d, digest(&a, &sig, b"m"));
    }

    #[test]
    fn owner_keys_parse_once_and_bad_points_stay_errors() {
        let k = crate::OwnerKey::from_secret_bytes(&[3; 32]).public();
        assert_eq!(owner_key(k.as_bytes()).unwrap(), k);
        assert_eq!(owner_key(k.as_bytes()).unwrap(), k);
        // A y coordinate with no point on the curve: refused every time, never remembered.
        let bad = (2u8..=255)
            .map(|y| {
                let mut b = [0u8; 32];
                b[0] = y;
                b
            })
            .find(|b| VerifyingKey::from_bytes(b).is_err())
            .expect("some small y is off the curve");
        assert!(owner_key(&bad).is_err());
        assert!(owner_key(&bad).is_err());
    }
}
