//! Starling's averager: peers agree on a group through the DHT and average flat `f32` tensors
//! with a chunked, quantized, bandwidth-aware butterfly all-reduce.
//!
//! - [`Averager`]: the handle an ML engineer embeds in a training loop; one
//!   [`Averager::step`] per averaging round, returning a [`RoundReport`].
//! - Matchmaking (module docs in `matchmaking.rs`): declare under a group key
//!   `{prefix}.averager.{schema hash}.{grid bits}` with an expiration equal to the end of the search
//!   window; the earliest declared peer leads; followers join; the leader begins when the group is
//!   full or its window closes with `min_group_size` members. Every wait has a timeout.
//! - [`partition`]: the load-balancing solve that sizes each member's span from the bandwidths
//!   it declared (measured from real transfers), so weak and client peers reduce little or nothing.
//! - The all-reduce (`allreduce.rs`): spans stream in chunks through `starling_compression`;
//!   reducers average part by part and return each part's deltas while later parts still
//!   arrive (send and return overlap); a stalled sender is left out of the parts not finished
//!   yet; a failed reducer's span is re-delegated to the surviving reducers in the same round
//!   when the deadline allows (otherwise it keeps its local values), and the report says exactly
//!   which spans (and parts) were averaged with whom.
//! - [`wire`]: every message and the framing (bounded frames).
//! - Transport: each sender-to-reducer exchange runs on the reducer's **fast lane** (a direct
//!   AES-256-GCM TCP connection keyed over libp2p, see `starling_node::fastlane`) when it has one,
//!   else on a libp2p stream; [`RoundReport::fast_lane_transfers`] says which. Uncompressed
//!   chunks go on the wire straight from the values, and model-sized buffers are reused from
//!   round to round.
//!
//! Departures from hivemind: the span split minimises the slowest peer's time under a
//! full-duplex cost model (bisection instead of an LP solver), acting only on bandwidth
//! differences larger than measurement noise ([`partition::denoise_bandwidths`]); reducers
//! send deltas rather than averaged values; a sender counts in a part only once it delivered
//! all of that part, and every part's result names exactly whose data it holds, so a partial
//! sender can never skew a mean.
//!
//! Not yet: gossip averaging, and local (intra-node) collectives.

mod allreduce;
mod averager;
mod config;
mod error;
mod lane;
mod matchmaking;
pub mod partition;
mod pool;
mod report;
pub mod wire;

pub use averager::Averager;
pub use config::{AveragerConfig, AveragingMode, Fault};
pub use error::AveragerError;
pub use report::{RoundReport, SpanOutcome, SpanReport};
