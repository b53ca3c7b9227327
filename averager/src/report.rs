//! What a round did: [`RoundReport`], and per span [`SpanReport`] / [`SpanOutcome`].

use std::ops::Range;
use std::time::Duration;

use starling_node::PeerId;

/// What happened to one span of the flattened vector in a round.
#[derive(Debug, Clone, PartialEq)]
pub enum SpanOutcome {
    /// Averaged; these members' data is in the result (always including this peer's, unless
    /// this peer is an `Aux` peer contributing nothing).
    Averaged {
        /// Peers whose data was averaged into this span.
        contributors: Vec<PeerId>,
    },
    /// The span's reducer failed (see [`SpanReport::reducer`]) and this part of its span was
    /// averaged again, in the same round, by a surviving member; the values are the weighted mean
    /// of these contributors' original values.
    Redelegated {
        /// The surviving member that reduced this part instead.
        to: PeerId,
        /// Peers whose data was averaged into this part (this peer's always among them).
        contributors: Vec<PeerId>,
    },
    /// Not averaged: the local values were kept.
    KeptLocal {
        /// Why.
        reason: String,
    },
}

impl SpanOutcome {
    /// The peers whose data is in this span's values, or `None` if the local values were kept.
    ///
    /// ```
    /// use starling_averager::SpanOutcome;
    /// let kept = SpanOutcome::KeptLocal { reason: "reducer failed".into() };
    /// assert!(kept.contributors().is_none());
    /// ```
    pub fn contributors(&self) -> Option<&[PeerId]> {
        match self {
            SpanOutcome::Averaged { contributors }
            | SpanOutcome::Redelegated { contributors, .. } => Some(contributors),
            SpanOutcome::KeptLocal { .. } => None,
        }
    }
}

/// One span of the flattened vector and its fate. A span whose reducer failed and was
/// re-delegated is reported as several parts (one per surviving reducer), each with the failed
/// reducer in `reducer` and its own range and outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanReport {
    /// The peer the span was assigned to (for a re-delegated part: the reducer that failed; the
    /// one that reduced it instead is in [`SpanOutcome::Redelegated`]).
    pub reducer: PeerId,
    /// Element range in the flattened vector.
    pub range: Range<usize>,
    /// What happened.
    pub outcome: SpanOutcome,
}

/// Everything the caller may want to know about a round.
#[derive(Debug, Clone)]
pub struct RoundReport {
    /// Round identifier (shared by the whole group).
    pub round_id: u64,
    /// The group, the leader first (member `i` reduced span `i`; the spans are laid out from a
    /// member the round's id picks, see [`crate::partition::rotated_spans`]).
    pub group: Vec<PeerId>,
    /// This peer's index in `group`.
    pub my_index: usize,
    /// One entry per non-empty span, or per part of a re-delegated span, in range order; together
    /// they cover the whole flattened vector.
    pub spans: Vec<SpanReport>,
    /// Peers that failed during the round (stalled, disconnected, or broke the protocol).
    pub failed_peers: Vec<PeerId>,
    /// Bytes written to averaging streams.
    pub bytes_sent: u64,
    /// Bytes read from averaging streams.
    pub bytes_received: u64,
    /// How many of this peer's span transfers ran over a fast lane (the others used libp2p
    /// streams; see [`crate::AveragerConfig::fast_lane`]).
    pub fast_lane_transfers: usize,
    /// Of those, how many reused a lane kept open from an earlier round with the same reducer
    /// (no new connection, no handshake: one round trip for the hello).
    pub warm_lane_transfers: usize,
    /// Time this step spent finding the group (with a search started ahead by
    /// [`crate::Averager::prepare`], only what was left of it when the step began).
    pub matchmaking_time: Duration,
    /// Whether the group came from a search started ahead by [`crate::Averager::prepare`].
    pub prepared: bool,
    /// Time spent in the all-reduce.
    pub allreduce_time: Duration,
    /// This round's measurement of this peer's upload rate (bytes/s), from its phase-1 sends;
    /// `None` when it sent too little to say (under 2 MiB). The bandwidth a peer declares
    /// ([`crate::Averager::bandwidth`]) is the median of its recent measurements.
    pub measured_upload: Option<f64>,
    /// When the group verifies ([`crate::AveragerConfig::verify`]) and this peer checked a
    /// block of another reducer's result this round: whose, and what it found.
    pub audit: Option<AuditReport>,
}

/// One check of another reducer's result (see [`crate::verify`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AuditReport {
    /// The reducer checked.
    pub reducer: PeerId,
    /// What the check found.
    pub outcome: AuditOutcome,
}

/// What checking a block of a reducer's result found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuditOutcome {
    /// The block recomputed to the result the reducer signed.
    Clean,
    /// The reducer lied (the evidence, described): its span was not applied, it is refused
    /// from now on, and the evidence is published.
    Caught(String),
    /// The reducer did not show the block, or what it showed did not check out (why): nothing
    /// is proven, but its span was not applied.
    Unanswered(String),
}

impl RoundReport {
    /// Fraction of this peer's elements that were averaged with at least one other peer.
    pub fn averaged_fraction(&self) -> f64 {
        averaged_fraction(&self.spans)
    }
}

/// Fraction of the elements `spans` cover that were averaged with at least one other peer.
pub(crate) fn averaged_fraction(spans: &[SpanReport]) -> f64 {
    let total: usize = spans.iter().map(|s| s.range.len()).sum();
    if total == 0 {
        return 0.0;
    }
    let done: usize = spans
        .iter()
        .filter(|s| s.outcome.contributors().is_some_and(|c| c.len() > 1))
        .map(|s| s.range.len())
        .sum();
    done as f64 / total as f64
}
