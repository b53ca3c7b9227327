//! Starling's record model on top of libp2p Kademlia.
//!
//! Kademlia stores opaque bytes under a key. Starling needs more: many peers write under one key
//! (a matchmaking group, the experts on a grid prefix), entries expire, and some entries may only be
//! written by their owner. This crate holds that model and nothing that talks to the network:
//!
//! - [`DictionaryRecord`]: the value under a key, a dictionary `subkey -> (bytes, expiration)`.
//!   [`DictionaryRecord::merge`] keeps, per sub-key, the entry with the latest expiration (ties are
//!   broken deterministically so every replica converges), and expired entries are never returned.
//! - Owner signatures ([`owner`]): a key or sub-key that embeds `[owner:<hex ed25519 public key>]`
//!   can only be written with a valid ed25519 signature by that key; the signature covers key,
//!   sub-key, value and expiration, so it cannot be moved to another entry or extended in time.
//! - [`Validator`] checks every inbound record against [`DhtLimits`] (sizes, counts, expiration
//!   horizon with a clock-skew tolerance) before anything is stored.
//! - [`DhtStore`]: a bounded `libp2p::kad::store::RecordStore` that validates and merges instead of
//!   overwriting, and charges each remote writer for the entries it sent (bytes, keys, sub-keys
//!   per key: [`WriterUsage`]), so no single peer can fill the store or squat a key. The node
//!   runs Kademlia with `StoreInserts::FilterBoth` and hands inbound PUTs to
//!   [`DhtStore::insert`] itself, so nothing reaches the store unvalidated.
//! - Typed values: [`encode_value`] / [`decode_value`] (postcard) for `serde` types.
//!
//! Departures from plain Kademlia: a PUT never overwrites a whole record, it merges; records are
//! bounded in size, count and total bytes, and per remote writer in bytes, keys and sub-keys per
//! key; provider records are not used.
//!
//! ```
//! use starling_dht::{DictionaryRecord, Entry, now_ms};
//! let mut a = DictionaryRecord::default();
//! a.insert(Entry::new("alice", b"1".to_vec(), now_ms() + 60_000));
//! let mut b = DictionaryRecord::default();
//! b.insert(Entry::new("alice", b"2".to_vec(), now_ms() + 120_000)); // later expiration wins
//! a.merge(b);
//! assert_eq!(a.get("alice").unwrap().value, b"2");
//! ```

#![warn(missing_docs)]

mod error;
pub mod lock;
pub mod owner;
mod quota;
mod record;
mod seen;
mod store;
mod time;
mod validate;

pub use ed25519_dalek::VerifyingKey;
pub use error::DhtError;
pub use owner::{owner_marker, required_owner, OwnerKey};
pub use quota::WriterUsage;
pub use record::{decode_value, encode_value, DictionaryRecord, Entry, RECORD_FORMAT_VERSION};
pub use store::{DhtStore, InsertOutcome, StoreStats};
pub use time::{now_ms, DhtTime};
pub use validate::{DhtLimits, Validator};
