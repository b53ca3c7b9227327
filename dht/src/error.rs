use thiserror::Error;

/// Everything that can be wrong with a record, a key or a stored value.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DhtError {
    /// The record bytes could not be decoded.
    #[error("malformed record: {0}")]
    Malformed(String),
    /// The record uses a format version this peer does not understand.
    #[error("unsupported record format version {0}")]
    UnsupportedVersion(u8),
    /// A size or count limit was exceeded.
    #[error("{what} is too large: {actual} > limit {limit}")]
    TooLarge {
        /// What was measured (key, sub-key, value, record, ...).
        what: &'static str,
        /// The measured size or count.
        actual: usize,
        /// The configured bound.
        limit: usize,
    },
    /// The expiration lies further in the future than the store accepts.
    #[error("expiration {expiration_ms} ms is beyond the accepted horizon {horizon_ms} ms")]
    ExpirationTooFar {
        /// The entry's expiration (unix ms).
        expiration_ms: u64,
        /// The latest expiration accepted now (unix ms).
        horizon_ms: u64,
    },
    /// The entry has already expired.
    #[error("entry for sub-key {subkey:?} has already expired")]
    Expired {
        /// The sub-key of the expired entry.
        subkey: String,
    },
    /// An owner-protected entry is unsigned or its signature does not verify.
    #[error("invalid or missing owner signature on key {key:?} sub-key {subkey:?}")]
    BadSignature {
        /// The record key.
        key: String,
        /// The sub-key whose signature failed.
        subkey: String,
    },
    /// An owner marker is malformed or key and sub-key name different owners.
    #[error("bad owner marker: {0}")]
    BadOwner(String),
    /// A key is not valid UTF-8.
    #[error("key is not valid UTF-8")]
    KeyNotUtf8,
    /// The store as a whole refuses more data (records or bytes).
    #[error("store is full: {0}")]
    StoreFull(&'static str),
    /// A remote writer would hold more than its quota in this store (see the per-writer limits
    /// of [`crate::DhtLimits`]). Its other entries stay; it may write again once some of what
    /// it holds expires or is replaced.
    #[error("writer is over its quota: its {what} would be {actual} > limit {limit}")]
    OverQuota {
        /// The quantity over its limit: `"bytes"`, `"keys"` or `"sub-keys under this key"`.
        what: &'static str,
        /// What the writer would hold with this record.
        actual: usize,
        /// The configured limit.
        limit: usize,
    },
    /// A typed value could not be encoded or decoded.
    #[error("value codec error: {0}")]
    Codec(String),
    /// This peer cannot sign for the owner named in the key.
    #[error("cannot write owner-protected entry: it belongs to another owner ({0})")]
    NotOwner(String),
}
