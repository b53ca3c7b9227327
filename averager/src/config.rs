//! Everything tunable about averaging ([`AveragerConfig`]), how a peer takes part
//! ([`AveragingMode`]), and the fault-injection points tests use (`testing` feature).

use std::time::Duration;

use starling_compression::Codec;

/// How a peer takes part in averaging.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum AveragingMode {
    /// Sends, receives and reduces a span sized by its bandwidth. A `Node` averager whose node
    /// accepts no inbound connections (client-mode node, or autonat found it behind a NAT)
    /// declares itself a `Client` for the round.
    Node,
    /// Behind NAT or by choice: accepts no inbound streams, reduces nothing, only sends its
    /// tensors to the reducers and receives the averaged result.
    Client,
    /// Reduces a span but contributes weight 0 (a helper with spare bandwidth).
    Aux,
}

/// Everything tunable about averaging. Build with [`AveragerConfig::new`] and adjust fields.
///
/// ```
/// use std::time::Duration;
/// use starling_averager::{AveragerConfig, AveragingMode};
/// let mut cfg = AveragerConfig::new("my-run");
/// cfg.target_group_size = 8;
/// cfg.matchmaking_time = Duration::from_secs(5);
/// cfg.codec = "f16".parse().unwrap();
/// assert_eq!(cfg.mode, AveragingMode::Node);
/// ```
#[derive(Debug, Clone)]
pub struct AveragerConfig {
    /// Names the training run: only peers with the same prefix (and tensor schema) group.
    pub prefix: String,
    /// A group starts as soon as it has this many peers.
    pub target_group_size: usize,
    /// A group whose leader's window closes starts if it has at least this many peers.
    pub min_group_size: usize,
    /// How long a peer declares itself searching (its window); leaders wait at most this long.
    pub matchmaking_time: Duration,
    /// How long a leader that has every peer declared under its key, but fewer than the group
    /// it expects, waits for members of its previous group that are still connected before it
    /// begins without them. `None` (the default): a tenth of `matchmaking_time`, at most half a
    /// second, for training loops that wait for the round. A round that runs in the background
    /// of compute (the collaborative optimizer's delayed update) can afford to wait longer for
    /// a peer that is merely late, and splitting the group costs it more.
    pub start_grace: Option<Duration>,
    /// Timeout of one control request (join, begin) and of opening a stream.
    pub request_timeout: Duration,
    /// A reducer waits at most this long for a sender's next chunk before excluding it from
    /// the span.
    pub sender_timeout: Duration,
    /// A sender waits at most this long for a reducer's result before keeping its local values
    /// for that span.
    pub reducer_timeout: Duration,
    /// A failed reducer's span is re-delegated to the surviving reducers, within the same round,
    /// only if at least this much time is left before the caller's deadline, on top of the
    /// span's estimated transfer time there and back at this peer's bandwidth; otherwise its
    /// values stay local. `Duration::MAX` turns re-delegation off.
    pub repair_min_time: Duration,
    /// Codec for the tensors on the wire (see `starling_compression::Codec`).
    pub codec: Codec,
    /// Runs the codec's output through the lossless zstd stage at this level, per frame,
    /// where it makes the frame smaller: it pays on sparse data (DCT top-k coefficients,
    /// [`crate::Averager::step_sparse`], turn it on themselves) and costs time on dense
    /// gradients. `None` (the default) sends frames as the codec made them.
    pub zstd_level: Option<i32>,
    /// How reducers combine the contributions to their spans: the weighted mean (the default)
    /// or a robust aggregator that lying peers cannot move far (see [`crate::Aggregation`]).
    /// Part of the schema: peers with different aggregations never group.
    pub aggregation: crate::Aggregation,
    /// Reducers are checked (see [`crate::verify`]): senders and reducers sign what they send,
    /// and after each round this peer recomputes one random block of another reducer's result
    /// with this probability (0 to 1). A reducer caught lying is refused by every peer that
    /// reads the evidence. 0 (the default) turns verification off. Whether it is on is part of
    /// the schema: peers that verify never group with peers that do not. Needs a
    /// coordinate-wise aggregation (not `centered-clip`).
    pub verify: f64,
    /// Largest chunk on the wire, in bytes.
    pub chunk_bytes: usize,
    /// Declared bandwidth in bytes per second; `None` uses the measured value (starting from
    /// [`AveragerConfig::initial_bandwidth`]).
    pub bandwidth: Option<f64>,
    /// Bandwidth assumed before the first measurement, in bytes per second.
    pub initial_bandwidth: f64,
    /// How this peer takes part.
    pub mode: AveragingMode,
    /// Number of grid bits in the group key; with `b > 0` peers rotate between `2^b` group keys
    /// from round to round (Moshpit-style), so information mixes across groups.
    pub group_bits: u32,
    /// Largest accepted frame on an averaging stream, in bytes (bounds every read buffer).
    pub max_frame_bytes: usize,
    /// Size spans by the load-balancing solve (`true`, the default) or split equally among the
    /// members that may reduce (`false`; for comparisons).
    pub load_balance: bool,
    /// Move span data over the node's fast lane (direct AES-256-GCM TCP connections, see
    /// `starling_node::fastlane`) where both peers have one; `false` uses libp2p streams only.
    /// A peer whose lane cannot be reached falls back to libp2p streams by itself.
    pub fast_lane: bool,
    /// A lying reducer, to test a swarm's defences (`starling train --byzantine reducer:K`):
    /// adds this to every value of the results this peer returns as a reducer (before sealing
    /// them when the group verifies), well-formed values that a group with
    /// [`AveragerConfig::verify`] above 0 catches and refuses, and one without applies. `None`
    /// (the default) for every peer meant to be honest.
    ///
    /// ```
    /// let mut cfg = starling_averager::AveragerConfig::new("defence-drill");
    /// cfg.verify = 1.0;
    /// cfg.result_bias = Some(1.0); // this peer's spans come back 1.0 too high
    /// ```
    pub result_bias: Option<f32>,
    /// Fault injection for tests: crash this peer at a chosen point of the next rounds
    /// (only with the `testing` feature).
    #[cfg(feature = "testing")]
    pub fault: Option<Fault>,
}

/// Where a test makes a peer crash (its node shuts down, dropping every connection). Exported
/// only with the `testing` feature; without it no fault can be configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub enum Fault {
    /// After the group formed, before sending anything.
    BeforeSending,
    /// After sending this many chunks to some reducer.
    AfterSentChunks(usize),
    /// After receiving every part of its own span, before returning results.
    WhileReducing,
    /// After returning its span's result to this many senders (in member order), before the
    /// others: the reducer dies having served only some of them.
    WhileReturning(usize),
    /// As leader, after accepting this many followers and before the round begins.
    LeaderAfterFollowers(usize),
    /// Sends nothing of its own, reduces its span and returns every result, then its node
    /// goes down: the other reducers wait for a part that never comes, while every send of
    /// theirs succeeded.
    SilentReducer,
    /// Breaks the all-reduce protocol in the way given: a rogue member whose malformed
    /// messages honest peers must refuse without corrupting a span or panicking.
    Rogue(Rogue),
}

/// How a rogue member breaks the all-reduce protocol (with the `testing` feature). Sender-side
/// lies are in its hello and data to every reducer; reducer-side lies are in the first part of
/// the result it returns to each sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub enum Rogue {
    /// Sender: its hello names a span this many elements longer than the real one.
    HelloLength(u64),
    /// Sender: its hello names the round id xor this mask (an unknown round).
    HelloRound(u64),
    /// Sender: its first chunk claims this element offset.
    ChunkOffset(u64),
    /// Sender: its first chunk arrives twice.
    DuplicateChunk,
    /// Sender: `SendDone` right after its first chunk.
    EarlyDone,
    /// Reducer: its first `Result` names this part (offset within the span, length).
    ResultRange {
        /// Claimed start.
        start: u64,
        /// Claimed length.
        len: u64,
    },
    /// Reducer: its first `Result` also lists this member index.
    Contributor(u32),
    /// Reducer: its first part's result arrives twice.
    DuplicateResult,
    /// Reducer: its first delta chunk claims this element offset.
    DeltaOffset(u64),
}

impl AveragerConfig {
    /// The start grace in force: `start_grace`, or by default a tenth of `matchmaking_time`,
    /// at most half a second.
    ///
    /// ```
    /// let cfg = starling_averager::AveragerConfig::new("run");
    /// assert_eq!(cfg.effective_start_grace(), std::time::Duration::from_millis(500));
    /// ```
    pub fn effective_start_grace(&self) -> Duration {
        self.start_grace
            .unwrap_or((self.matchmaking_time / 10).min(Duration::from_millis(500)))
    }

    /// Defaults for a run named `prefix`: groups of 4 (at least 2), 5 s matchmaking, no
    /// compression, 1 MiB chunks.
    pub fn new(prefix: impl Into<String>) -> Self {
        AveragerConfig {
            prefix: prefix.into(),
            target_group_size: 4,
            min_group_size: 2,
            matchmaking_time: Duration::from_secs(5),
            start_grace: None,
            request_timeout: Duration::from_secs(5),
            sender_timeout: Duration::from_secs(5),
            reducer_timeout: Duration::from_secs(10),
            repair_min_time: Duration::from_secs(1),
            codec: Codec::None,
            zstd_level: None,
            aggregation: crate::Aggregation::Mean,
            verify: 0.0,
            chunk_bytes: 1 << 20,
            bandwidth: None,
            initial_bandwidth: 100e6,
            mode: AveragingMode::Node,
            group_bits: 0,
            max_frame_bytes: 16 << 20,
            load_balance: true,
            fast_lane: true,
            result_bias: None,
            #[cfg(feature = "testing")]
            fault: None,
        }
    }

    /// The fault to inject, if any (always `None` without the `testing` feature).
    pub(crate) fn fault(&self) -> Option<Fault> {
        #[cfg(feature = "testing")]
        return self.fault;
        #[cfg(not(feature = "testing"))]
        None
    }

    pub(crate) fn validate(&self) -> Result<(), crate::AveragerError> {
        let bad = |m: &str| Err(crate::AveragerError::Config(m.to_string()));
        if self.prefix.is_empty() || self.prefix.len() > 128 {
            return bad("prefix must be 1 to 128 bytes");
        }
        if self.min_group_size < 1 || self.target_group_size < self.min_group_size {
            return bad("need 1 <= min_group_size <= target_group_size");
        }
        if self.target_group_size > 256 {
            return bad("target_group_size is at most 256");
        }
        if self.chunk_bytes < 4096 || self.chunk_bytes + 4096 > self.max_frame_bytes {
            return bad(
                "chunk_bytes must be at least 4096 and leave 4 KiB of room below max_frame_bytes",
            );
        }
        if self.start_grace.is_some_and(|g| g > self.matchmaking_time) {
            return bad("start_grace must not exceed matchmaking_time");
        }
        if self.group_bits > 16 {
            return bad("group_bits is at most 16");
        }
        self.aggregation
            .validate()
            .map_err(crate::AveragerError::Config)?;
        if !(0.0..=1.0).contains(&self.verify) {
            return bad("verify is a probability, from 0 to 1");
        }
        if self.verify > 0.0 && !self.aggregation.is_coordinatewise() {
            return bad("verify needs a coordinate-wise aggregation (mean, median, trimmed-mean): centered-clip cannot be recomputed one block at a time");
        }
        if self.result_bias.is_some_and(|b| !b.is_finite()) {
            return bad("result_bias must be a finite number");
        }
        if let Some(b) = self.bandwidth {
            if !(b.is_finite() && b > 0.0) {
                return bad("bandwidth must be a positive number of bytes per second");
            }
        }
        Ok(())
    }
}
