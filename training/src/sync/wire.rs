//! The messages of `/starling/state/1`, all in one place.
//!
//! A joiner opens a stream and sends [`Hello`]; the donor answers [`HelloReply`] (through
//! `starling_node::streams`, which retries streams the accept queue dropped). Then the joiner
//! sends [`Request`]s one at a time; each is answered by one tagged frame: [`TAG_MANIFEST`]
//! (the manifest's bytes), [`TAG_CHUNK`] (a chunk's little-endian `f32` bytes) or [`TAG_REPLY`]
//! (a postcard [`Reply`]: stale, busy, no such chunk). Either side may close the stream at any
//! time; a donor closes streams idle for longer than its request timeout.

use serde::{Deserialize, Serialize};
use starling_node::StreamProtocol;

use super::manifest::Digest;

/// The state sync protocol.
pub const PROTOCOL: StreamProtocol = StreamProtocol::new("/starling/state/1");

/// Version in [`Hello`]; a donor answers another with [`HelloReply::Unsupported`].
pub(crate) const WIRE_VERSION: u32 = 1;

/// Largest control message (hello, reply, request), in bytes.
pub(crate) const MAX_CONTROL_BYTES: usize = 1024;

/// A frame holding a postcard [`Reply`].
pub(crate) const TAG_REPLY: u8 = 0;
/// A frame holding the encoded manifest.
pub(crate) const TAG_MANIFEST: u8 = 1;
/// A frame holding one chunk's bytes.
pub(crate) const TAG_CHUNK: u8 = 2;

/// The joiner's first message on a stream.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Hello {
    pub version: u32,
}

/// The donor's answer to [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum HelloReply {
    /// Ready to serve the snapshot whose manifest hashes to `manifest_hash`.
    Ready { epoch: u64, manifest_hash: Digest },
    /// It serves no snapshot yet.
    NoState,
    /// Too many streams, in all or from this peer: try later or elsewhere.
    Busy,
    /// Another wire version.
    Unsupported { version: u32 },
}

/// A joiner's request after the hello.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Request {
    /// The manifest of the snapshot this stream's hello announced (kept for the stream).
    Manifest,
    /// Chunk `index` of the snapshot whose manifest hashes to `manifest_hash`.
    Chunk { manifest_hash: Digest, index: u64 },
}

/// A donor's answer that is not data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Reply {
    /// The snapshot asked for is no longer served (`None`: none is).
    Stale { now: Option<(u64, Digest)> },
    /// There is no chunk `index`; the snapshot has `chunks`.
    NoSuchChunk { index: u64, chunks: u64 },
}
