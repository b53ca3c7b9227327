use thiserror::Error;

/// Errors from averaging.
#[derive(Debug, Error)]
pub enum AveragerError {
    /// The configuration is inconsistent.
    #[error("invalid averager configuration: {0}")]
    Config(String),
    /// The tensors passed to `step` do not match the schema the averager was built for.
    #[error("tensor schema mismatch: {0}")]
    Schema(String),
    /// The local tensors or the weight hold NaN or infinity.
    #[error("non-finite input: {0}")]
    NonFinite(String),
    /// No group of at least `min_group_size` formed before the deadline.
    #[error("no group of at least {min} peers formed before the deadline ({searched_ms} ms of matchmaking)")]
    NoGroup {
        /// The minimum group size.
        min: usize,
        /// How long matchmaking ran.
        searched_ms: u64,
    },
    /// The deadline passed.
    #[error("deadline passed during {0}")]
    Deadline(&'static str),
    /// A peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A stream failed.
    #[error("stream error: {0}")]
    Io(#[from] std::io::Error),
    /// The node failed.
    #[error(transparent)]
    Node(#[from] starling_node::NodeError),
    /// Encoding or decoding a tensor failed.
    #[error(transparent)]
    Compression(#[from] starling_compression::Error),
    /// Another averager already serves this node.
    #[error("an averager is already running on this node")]
    AlreadyRunning,
    /// The averager has shut down.
    #[error("the averager has shut down")]
    Closed,
}
