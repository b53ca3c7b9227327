//! Errors of the experts crate: [`ExpertError`] for callers, and [`RemoteError`], what a
//! server tells a client when it refuses or fails a call.

use serde::{Deserialize, Serialize};
use starling_node::PeerId;
use thiserror::Error;

/// What went wrong, on the server or the client side.
#[derive(Debug, Error)]
pub enum ExpertError {
    /// A tensor operation failed (shapes, numerics).
    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The node (DHT, streams) failed.
    #[error(transparent)]
    Node(#[from] starling_node::NodeError),
    /// A stream failed.
    #[error("stream error: {0}")]
    Io(#[from] std::io::Error),
    /// Compression or decompression of a payload failed.
    #[error("payload codec: {0}")]
    Codec(#[from] starling_compression::Error),
    /// The peer broke the protocol (malformed or oversized frame, unexpected message).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The server hosting the expert answered the call with an error ([`RemoteError`]).
    #[error("expert {uid} on {peer}: {kind}: {message}")]
    Remote {
        /// The expert called.
        uid: String,
        /// The server that answered (its `PeerId`, printed; a `PeerId` itself would make every
        /// `Result` of this crate twice as large).
        peer: String,
        /// The class of error.
        kind: RemoteErrorKind,
        /// What the server said.
        message: String,
    },
    /// A request did not complete in time.
    #[error("timed out: {0}")]
    Timeout(String),
    /// Input does not match an expert's schema, or a configuration is invalid.
    #[error("invalid input: {0}")]
    Invalid(String),
    /// Too few experts answered for some sample.
    #[error("only {answered} of the required {k_min} experts answered for sample {sample}")]
    NotEnoughExperts {
        /// The first sample short of answers.
        sample: usize,
        /// How many answered for it.
        answered: usize,
        /// The configured minimum.
        k_min: usize,
    },
    /// Saving or loading a checkpoint failed.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file.
        path: String,
        /// What failed.
        message: String,
    },
    /// The server or runtime has shut down.
    #[error("the expert server has shut down")]
    Closed,
}

/// An error a server reports to a client: its class and the server's explanation. It travels
/// as [`Response::Error`](crate::wire::Response::Error); the client turns it into
/// [`ExpertError::Remote`], which also names the expert and the server.
///
/// ```
/// use starling_experts::{ExpertError, RemoteError, RemoteErrorKind};
/// let peer = starling_node::PeerId::random();
/// let e = RemoteError::new(RemoteErrorKind::Overloaded, "4096 samples already queued");
/// let e = e.into_expert_error("ffn.0.3", peer);
/// assert!(matches!(e, ExpertError::Remote { kind: RemoteErrorKind::Overloaded, .. }));
/// assert!(e.to_string().starts_with("expert ffn.0.3 on "));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{kind}: {message}")]
pub struct RemoteError {
    /// The class of error.
    pub kind: RemoteErrorKind,
    /// What the server says about it.
    pub message: String,
}

impl RemoteError {
    /// An error of class `kind`.
    pub fn new(kind: RemoteErrorKind, message: impl Into<String>) -> RemoteError {
        RemoteError {
            kind,
            message: message.into(),
        }
    }

    /// The error as the caller of expert `uid` on server `peer` sees it.
    pub fn into_expert_error(self, uid: &str, peer: PeerId) -> ExpertError {
        ExpertError::Remote {
            uid: uid.to_string(),
            peer: peer.to_string(),
            kind: self.kind,
            message: self.message,
        }
    }
}

/// The classes of error a server reports to a client. Sent on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RemoteErrorKind {
    /// No expert with that uid is hosted here.
    UnknownExpert,
    /// Wrong number of tensors, wrong shapes or dtype for the expert's schema.
    BadSchema,
    /// The request is larger than the server accepts (rows or bytes).
    TooLarge,
    /// The payload could not be decoded, or held NaN/Inf.
    Malformed,
    /// The expert's queue is full: retry later or elsewhere.
    Overloaded,
    /// The computation failed on the server.
    Internal,
    /// The server is shutting down.
    ShuttingDown,
}

impl std::fmt::Display for RemoteErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RemoteErrorKind::UnknownExpert => "no such expert on that server",
            RemoteErrorKind::BadSchema => "the request does not fit the expert's schema",
            RemoteErrorKind::TooLarge => "the request is larger than the server accepts",
            RemoteErrorKind::Malformed => "the request could not be decoded",
            RemoteErrorKind::Overloaded => "the server is overloaded (retry later or elsewhere)",
            RemoteErrorKind::Internal => "the computation failed on the server",
            RemoteErrorKind::ShuttingDown => "the server is shutting down",
        })
    }
}

/// Frame errors on an expert stream: a frame over the limit or a body that does not decode is
/// the peer breaking the protocol; a failed stream is I/O.
impl From<starling_node::framing::FrameError> for ExpertError {
    fn from(e: starling_node::framing::FrameError) -> Self {
        use starling_node::framing::FrameError;
        match e {
            FrameError::Io(e) => ExpertError::Io(e),
            FrameError::Malformed(m) => ExpertError::Protocol(m),
            too_large @ FrameError::TooLarge { .. } => ExpertError::Protocol(too_large.to_string()),
        }
    }
}

/// Result alias.
pub type Result<T, E = ExpertError> = std::result::Result<T, E>;
