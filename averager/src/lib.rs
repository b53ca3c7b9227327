//! Starling's averager: peers agree on a group through the DHT and average flat `f32` tensors
//! with a chunked, quantized, bandwidth-aware butterfly all-reduce.
//!
//! - [`Averager`]: the handle an ML engineer embeds in a training loop; one
//!   [`Averager::step`] (async) or [`Averager::step_blocking`] (from a plain thread) per
//!   averaging round, returning a [`RoundReport`] that says what happened to every span.
//! - [`AveragerConfig`]: every tunable, with defaults; [`AveragerError`]: one variant per cause.
//! - [`partition`]: the load-balancing solve that sizes each member's span from the bandwidths
//!   it declared (measured from real transfers), so weak and client peers reduce little or
//!   nothing.
//! - [`wire`]: every message and the framing (bounded frames, `starling_node::framing`).
//! - [`verify`]: checked reducers (`AveragerConfig::verify`): signed commitments, random
//!   recomputation of result blocks, [`verify::Evidence`] anyone can check, and liars refused.
//! - [`devices`]: local collectives across the devices of one machine ([`LocalGroup`]: CPU threads, or
//!   NCCL with the `cuda` feature) and [`Hierarchical`] averaging, where one averager speaks
//!   for the whole machine in the swarm.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::{Duration, Instant};
//! use starling_averager::{Averager, AveragerConfig};
//! use starling_node::{Node, NodeConfig};
//! let node = Node::start(NodeConfig::default()).await?;
//! let averager = Averager::new(node, AveragerConfig::new("my-run")).await?;
//! let mut params = vec![1.0f32; 1000];
//! let report = averager
//!     .step(&mut [&mut params[..]], 1.0, Instant::now() + Duration::from_secs(30))
//!     .await?;
//! println!("{:.0}% averaged with {} peers", 100.0 * report.averaged_fraction(), report.group.len());
//! # Ok(()) }
//! ```
//!
//! # Where training compute runs
//!
//! The averager's network work runs on tokio tasks. Run model compute elsewhere: a training
//! loop on its own thread calling [`Averager::step_blocking`], or, in async code,
//! `tokio::task::spawn_blocking` for each compute step. Compute on the runtime's worker threads
//! starves the tasks that move averaging data: measured here, it tripled round times.
//!
//! # Matchmaking
//!
//! A step first finds a group. Peers declare themselves in the DHT under a group key
//! `{prefix}.averager.{schema hash}.{grid index}`, so only peers of the same run with the same
//! tensor sizes and codec meet (and, with `group_bits > 0`, only those in the same grid cell:
//! peers move between cells from round to round, Moshpit-style, so information mixes across
//! groups). A declaration carries the end of the peer's search window (`matchmaking_time`,
//! cut to the deadline); the earliest window leads. One peer's states in one window:
//!
//! - **searching**: declared; reads the key (at once, then 25, 50 and 100 ms later, then every
//!   200 ms: a peer that declared just after the first read is seen soon) and asks the
//!   earliest-declared peer ahead of it
//!   (never a client, never one that refused for good) to take it. Requests only go to peers
//!   declared *earlier*, so they never form a cycle and the earliest peer ends up leading. A
//!   client never leads, so it asks the earliest leader whatever its own rank, and leaders
//!   take clients whatever theirs.
//! - **requesting / following**: a join request is in flight, or was accepted and the peer waits
//!   for the leader's `Begin` (until the leader's window end plus `request_timeout`). A
//!   refusal, a `Disband`, a timeout or a dead leader send it back to searching; after a refusal
//!   it asks the next candidate at once.
//! - **leading**: accepted at least one follower; it begins as soon as the group has
//!   `target_group_size` members, or at its window end if it has `min_group_size`; otherwise it
//!   disbands and everyone searches again in a new window. While not full it keeps reading the
//!   key: if a peer declared earlier is searching, it disbands and joins that peer, so groups
//!   merge towards the earliest peer instead of splitting.
//!
//! A leader accepts a follower only if it still ranks ahead of it under its *current*
//! declaration (a follower may have read an older one). Join requests are answered by the
//! searching task itself, so a peer is never both leading and following.
//!
//! **A group that held the whole swarm re-forms without reading the key.** When a peer's
//! previous group held every peer the caller expects ([`Averager::expect_peers`], which the
//! collaborative optimizer sets from the run's progress), its members take the smallest peer id
//! among them as leader without a word. Everyone still declares; the leader reads the key only
//! after 25 ms, accepts its previous members whatever their rank and begins as soon as all of
//! them joined; the others ask it directly instead of reading (again every 5 ms while it is not
//! searching yet) and search as above when it answers otherwise or after half the start grace.
//! A group formed in a tagged round ([`Averager::set_round_tag`]) that holds every expected peer
//! also leaves its members' declarations open instead of closing them: nobody else searches
//! under that tag, and each member's next search (the next tag) replaces its declaration. A
//! stable pair's step then makes two DHT operations on the key instead of six. Without a hint
//! (`expect_peers` never called) every search reads, and every group closes.
//!
//! **A lone peer gives up after one window**: if nobody else searched under its key for a whole
//! window, the step returns [`AveragerError::NoGroup`] with `alone: true` instead of searching
//! until the deadline, and training goes on with local values. If other peers of the run were
//! searching with *another* schema (tensor sizes, order or codec), the error is
//! [`AveragerError::SchemaMismatch`], naming both schemas.
//!
//! # The all-reduce
//!
//! The group's member list (leader first) fixes every member's **span**: one contiguous range of
//! the flattened vector per member, sized by [`partition::solve_fractions`] over the declared
//! bandwidths after [`partition::denoise_bandwidths`] (clients and weak peers get none), laid out
//! from a member the round's id picks ([`partition::rotated_spans`]: a group that re-forms in
//! the same order does not leave each member the same part of the vector). Each sender streams
//! its values of span `j` to reducer `j` (over `j`'s fast lane, a direct AES-256-GCM TCP
//! connection keyed over libp2p, when it has one; else a libp2p stream;
//! [`RoundReport::fast_lane_transfers`] says which), in order, in chunks of `chunk_bytes`
//! compressed by the configured codec.
//!
//! The reducer works **part by part** (a part is one chunk's worth of elements): as soon as
//! every present sender has delivered a part, and every expected sender has shown up (or the
//! no-show time passed), it computes that part's weighted mean and streams back to each
//! contributor its *delta* `mean - received`, while the following parts are still arriving, so
//! the return traffic overlaps the send traffic on the same full-duplex stream. With a lossy
//! codec, deltas rather than values keep quantization error from compounding: a sender adds the
//! delta to what the reducer decoded of its values, which lands exactly on the mean. With the
//! exact codec `none` the reducer returns the mean itself, so every member of a completed round
//! holds **bit-identical** values (what a shared optimizer step needs).
//!
//! A sender that stalls past `sender_timeout` or breaks the protocol is left out of the parts
//! not finished yet. Every part's `Result` names exactly the members whose data is in its mean,
//! and reports give one [`SpanReport`] per run of parts with the same contributors, so a partial
//! sender can never skew a mean. A sender keeps its results only if every part of the span came
//! back. Uncompressed chunks go on the wire straight from the values, and model-sized buffers
//! are reused from round to round.
//!
//! # Re-delegation
//!
//! A sender whose reducer *failed* (unreachable, stalled past its timeouts, disconnected, broke
//! the protocol, or does not know the round) re-delegates that reducer's span in the same round
//! ([`SpanOutcome::Redelegated`]), if the deadline leaves `repair_min_time` plus the span's
//! estimated transfer time:
//!
//! - **Plan.** The span is split over the *surviving reducers* (members with a non-empty span,
//!   other than the failed one and any reducer this peer saw fail) by the same load-balancing
//!   solve, applied to their declared bandwidths. Peers that saw the same failures compute the
//!   same plan.
//! - **Parts.** For each part the sender sends its *original* values to that part's reducer
//!   behind a `RepairHello` naming the failed reducer and the part; the reducer averages them
//!   with its own original values and returns deltas, as in the first phase. A part that falls
//!   to this peer is reduced by this peer.
//! - **Agreement.** A reducer serves a part only if its own plan gives it exactly that part, so
//!   every contributor of a part agreed on it.
//! - **Partial delivery.** A peer that received the failed reducer's result before it died keeps
//!   that result; when a repair hello reaches it, it serves its planned part and also sends its
//!   original values to the plan's other parts, so the peers that lost the span average with
//!   every survivor without waiting for it.
//! - **Waiting.** Only a peer that lost a span waits for this phase, and only for its own parts:
//!   a clean round costs the caller nothing. After the round, a peer that can reduce keeps
//!   serving other members' parts in the background for `request_timeout` (one finished round
//!   at a time). Every wait is bounded by the caller's deadline; a part not back by then keeps
//!   its local values (there is no second repair), and the report says why.
//!
//! Departures from hivemind: the span split minimises the slowest peer's time under a
//! full-duplex cost model (bisection instead of an LP solver), acting only on bandwidth
//! differences larger than measurement noise; reducers send deltas rather than averaged values;
//! a failed reducer's span is re-delegated within the round.
//!
//! # Reconciling state after a round
//!
//! [`Averager::reconcile`] runs after a step, in the same group (no matchmaking), under round
//! ids derived from the step's. The members first average 64 digest bits of their state, each
//! bit as 0.0 or 1.0, every member weighted alike, with the plain mean whatever the configured
//! aggregator: a bit's mean is exactly 0 or 1 only where every member sent the same bit, and
//! otherwise at least `1/n` from both. If every member's bits were in and all agreed, nothing
//! more is sent (about a kilobyte per member in all). Otherwise the members average the state
//! itself with the exact codec and the configured aggregator. Every member that saw the whole
//! comparison makes the same choice. A member that did not see all of it keeps its state and
//! says so. If the others then average without it, they wait for its span until their
//! timeouts, as with any member that leaves mid-round. What it cannot catch: a member that
//! lies about its digest (use [`AveragerConfig::verify`] and a robust aggregator for liars),
//! and two different states with colliding 64-bit digests (about 2^-64 per pair).
//!
//! # Gossip
//!
//! [`gossip::GossipAverager`] averages with a few neighbours chosen by a topology over the
//! run's live members instead of a whole group, asynchronously, with a mass-preserving
//! pairwise exchange (see the [`gossip`] module docs); it shares this crate's transport, accept
//! loops, framing and codecs, and can run beside an [`Averager`] on the same node.
//!
//! # Internals
//!
//! Dependencies inside the crate point one way: `averager` → {`matchmaking`, `allreduce`} →
//! {`group`, `router`, `transport`, `wire`, `pool`}, with `allreduce` split into `plan`, `send`,
//! `reduce` (the no-I/O `PartReducer`) and `repair`. Fault-injection hooks (`Fault`,
//! `AveragerConfig::fault`) exist only with the `testing` feature.

#![warn(missing_docs)]

mod aggregation;
mod allreduce;
mod averager;
mod bandwidth;
mod config;
pub mod devices;
mod error;
mod feedback;
pub mod gossip;
mod group;
mod matchmaking;
mod metrics;
pub mod partition;
mod pool;
mod report;
mod router;
mod transport;
pub mod verify;
pub mod wire;

pub use aggregation::Aggregation;
pub use averager::{Averager, Reconciliation};
pub use config::{AveragerConfig, AveragingMode};
#[cfg(feature = "testing")]
pub use config::{Fault, Rogue};
pub use devices::{Hierarchical, LocalGroup};
pub use error::AveragerError;
pub use feedback::Residuals;
pub use metrics::{AveragerBoard, RoundRecord};
pub use report::{AuditOutcome, AuditReport, RoundReport, SpanOutcome, SpanReport};
