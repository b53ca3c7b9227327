//! The averager's error type: one variant per cause, each message saying what to check.

use thiserror::Error;

/// Errors from averaging.
#[derive(Debug, Error)]
pub enum AveragerError {
    /// The configuration is inconsistent.
    #[error("invalid averager configuration: {0}")]
    Config(String),
    /// The tensors passed to `step` cannot be averaged (for example, there are no elements).
    #[error("invalid tensors: {0}")]
    Schema(String),
    /// Other peers of the run were searching for a group, but with another tensor schema
    /// (tensor sizes or codec), so none could group with this peer.
    #[error("no group formed: this peer averages {mine}, but the other peers searching in this run average {}; every peer must pass the same tensor sizes, in the same order, with the same codec", others.join(" / "))]
    SchemaMismatch {
        /// This peer's schema (tensor count, elements, codec and hash).
        mine: String,
        /// The schemas other searching peers declared.
        others: Vec<String>,
    },
    /// The local tensors hold NaN or infinity.
    #[error("non-finite input: {0}")]
    NonFinite(String),
    /// The weight is negative, NaN or infinite.
    #[error("invalid weight {0}: a weight is a finite number >= 0 (e.g. the samples behind this update)")]
    InvalidWeight(f32),
    /// No group of at least `min_group_size` formed before the deadline.
    #[error("no group of at least {min} peers formed before the deadline ({searched_ms} ms of matchmaking{})", if *alone { "; no other peer searched with this peer's run prefix and schema" } else { "" })]
    NoGroup {
        /// The minimum group size.
        min: usize,
        /// How long matchmaking ran.
        searched_ms: u64,
        /// True if no other peer searched under this peer's group key during a whole window
        /// (a lone peer gives up after one window instead of searching until the deadline).
        alone: bool,
    },
    /// Another peer searched for a group with a greater round tag
    /// ([`crate::Averager::set_round_tag`]): this peer is behind (e.g. an epoch behind the
    /// swarm). Found within one read of the group key, not after a whole window; the caller
    /// catches up (takes the tag, or syncs state) and steps again.
    #[error("behind: this peer searched with round tag {mine}, another peer with {theirs}")]
    Behind {
        /// This peer's tag.
        mine: u64,
        /// The greatest tag seen.
        theirs: u64,
    },
    /// The deadline passed (or had passed before the step began).
    #[error("the deadline passed {0}")]
    Deadline(&'static str),
    /// A step is already running on this averager; steps run one at a time.
    #[error("a step is already running on this averager (steps run one at a time)")]
    StepInProgress,
    /// [`crate::Averager::step_blocking`] was called from inside an async runtime, where
    /// blocking would stall the runtime's own tasks.
    #[error("step_blocking called from inside an async runtime: use the async `step` there, or call step_blocking from a plain thread")]
    BlockingInRuntime,
    /// A peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A stream failed.
    #[error("stream error: {0}")]
    Io(#[from] std::io::Error),
    /// The node failed; `Node(Closed)` when this peer's own node stopped.
    #[error(transparent)]
    Node(#[from] starling_node::NodeError),
    /// Encoding or decoding a tensor failed.
    #[error(transparent)]
    Compression(#[from] starling_compression::Error),
    /// Another averager already serves this node.
    #[error("an averager is already running on this node")]
    AlreadyRunning,
}

impl From<starling_node::framing::FrameError> for AveragerError {
    fn from(e: starling_node::framing::FrameError) -> Self {
        match e {
            starling_node::framing::FrameError::Io(e) => AveragerError::Io(e),
            other => AveragerError::Protocol(other.to_string()),
        }
    }
}
