//! Everything tunable about gossip averaging: [`GossipConfig`].

use std::time::Duration;

use starling_compression::Codec;

use super::Topology;

/// Everything tunable about gossip averaging. Build with [`GossipConfig::new`] and adjust
/// fields or use the builder methods.
///
/// ```
/// use std::time::Duration;
/// use starling_averager::gossip::{GossipConfig, Topology};
/// let cfg = GossipConfig::new("my-run")
///     .topology(Topology::OnePeerExponential)
///     .alpha(0.5)
///     .codec("f16".parse().unwrap());
/// assert_eq!(cfg.exchange_timeout, Duration::from_secs(10));
/// ```
#[derive(Debug, Clone)]
pub struct GossipConfig {
    /// Names the run: peers declare under `{prefix}.gossip` and only exchange with peers of the
    /// same prefix, element count and codec.
    pub prefix: String,
    /// The graph (see [`Topology`]).
    pub topology: Topology,
    /// Mixing weight `alpha` (0 < alpha <= 1): an exchange moves each side `alpha` of the way
    /// to the pair's weighted mean (1: both end on it).
    pub alpha: f64,
    /// Codec of the vectors on the wire (both directions).
    pub codec: Codec,
    /// Largest chunk on the wire, in bytes.
    pub chunk_bytes: usize,
    /// Largest accepted frame, in bytes (bounds every read buffer).
    pub max_frame_bytes: usize,
    /// Opening a stream and waiting for the other side's answer, at most.
    pub request_timeout: Duration,
    /// One whole exchange (values out, difference back, confirmation), at most, on either side.
    pub exchange_timeout: Duration,
    /// How long a round keeps retrying a neighbour that answered busy (or not serving yet)
    /// before moving on; each retry waits a random 5-25 ms, growing with the attempts.
    pub busy_patience: Duration,
    /// A neighbour that failed (no answer, broken stream, timeout) is skipped for this long,
    /// doubling with each further failure up to [`GossipConfig::max_backoff`]; skipped peers
    /// are left out of the graph, so the topology closes over the gap.
    pub backoff: Duration,
    /// Longest skip after repeated failures.
    pub max_backoff: Duration,
    /// A declaration in the DHT lasts this long (renewed every third of it while the peer
    /// gossips): a peer that stops is forgotten after at most this.
    pub membership_ttl: Duration,
    /// Re-read the members from the DHT at most this often.
    pub membership_refresh: Duration,
    /// Move vectors over the node's fast lane where both peers have one.
    pub fast_lane: bool,
}

impl GossipConfig {
    /// Defaults for a run named `prefix`: one-peer exponential graph, alpha 1 (pairwise
    /// averaging), exact codec, 1 MiB chunks, 10 s exchanges, 1 s back-off (up to 60 s), 30 s
    /// membership TTL re-read every 5 s.
    pub fn new(prefix: impl Into<String>) -> Self {
        GossipConfig {
            prefix: prefix.into(),
            topology: Topology::OnePeerExponential,
            alpha: 1.0,
            codec: Codec::None,
            chunk_bytes: 1 << 20,
            max_frame_bytes: 16 << 20,
            request_timeout: Duration::from_secs(5),
            exchange_timeout: Duration::from_secs(10),
            busy_patience: Duration::from_millis(500),
            backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            membership_ttl: Duration::from_secs(30),
            membership_refresh: Duration::from_secs(5),
            fast_lane: true,
        }
    }

    /// Sets the topology.
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = topology;
        self
    }

    /// Sets the mixing weight (0 < alpha <= 1).
    pub fn alpha(mut self, alpha: f64) -> Self {
        self.alpha = alpha;
        self
    }

    /// Sets the codec.
    pub fn codec(mut self, codec: Codec) -> Self {
        self.codec = codec;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), crate::AveragerError> {
        let bad = |m: &str| Err(crate::AveragerError::Config(m.to_string()));
        if self.prefix.is_empty() || self.prefix.len() > 128 {
            return bad("gossip prefix must be 1 to 128 bytes");
        }
        if !(self.alpha > 0.0 && self.alpha <= 1.0) {
            return bad("gossip alpha (mixing weight) must be in (0, 1]");
        }
        if self.chunk_bytes < 4096 || self.chunk_bytes + 4096 > self.max_frame_bytes {
            return bad(
                "chunk_bytes must be at least 4096 and leave 4 KiB of room below max_frame_bytes",
            );
        }
        if let super::Topology::RandomK(0) = self.topology {
            return bad("random-k needs k >= 1");
        }
        if self.membership_ttl < Duration::from_secs(1) {
            return bad("membership_ttl must be at least 1 s");
        }
        if self.backoff.is_zero() || self.max_backoff < self.backoff {
            return bad("need 0 < backoff <= max_backoff");
        }
        Ok(())
    }
}
