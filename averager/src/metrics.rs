//! The averager's Prometheus metrics, registered in its node's registry
//! ([`starling_node::Node::metrics`]) under `starling_averager_*`:
//!
//! - `rounds_total{outcome}`: steps that ended `ok` (every span averaged, nobody failed),
//!   `partial` (a member failed or some spans kept their local values) or `failed` (no round:
//!   no group, an error);
//! - `group_size`: members per round (histogram);
//! - `bytes_total{protocol, lane, direction}`: bytes of span data moved over each transport,
//!   `lane` being `fast` (the direct encrypted lane) or `libp2p` (streams), counted as they
//!   cross the wire;
//! - `bandwidth_bytes_per_second`: the bandwidth this peer declares (measured upload rate);
//! - `allreduce_seconds` and `matchmaking_seconds`: how long rounds take (histograms).
//!
//! Each round is also added to the node's journal of [`RoundRecord`]s (what a dashboard shows),
//! and the measured bandwidth to its board as the [`AveragerBoard`] section (what its heartbeat
//! says).

use std::io;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::task::{Context, Poll};

use futures::{AsyncRead, AsyncWrite};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use serde::{Deserialize, Serialize};
use starling_node::board::Section;
use starling_node::metrics::latency_buckets;
use starling_node::Node;

use crate::{AveragerError, RoundReport};

/// One averaging round as a dashboard shows it, kept in the node's journal
/// (`node.metrics().journal::<RoundRecord>()`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundRecord {
    /// When the round ended (unix ms).
    pub time_ms: u64,
    /// The group's round id (0 when no group was found).
    pub round_id: u64,
    /// Members in the group, this peer included (0 when no group was found).
    pub group_size: usize,
    /// `ok` (everything averaged with everyone), `partial` (some spans kept local or a member
    /// failed) or `failed` (no round: no group, an error).
    pub outcome: String,
    /// Fraction of this peer's elements averaged with at least one other peer.
    pub averaged_fraction: f64,
    /// Bytes this peer wrote to averaging streams.
    pub bytes_sent: u64,
    /// Bytes this peer read from averaging streams.
    pub bytes_received: u64,
    /// Seconds spent in the all-reduce.
    pub allreduce_seconds: f64,
    /// What went wrong, for failed rounds.
    pub error: Option<String>,
}

/// The averager's section of its node's board (see [`starling_node::board`]): what the
/// heartbeat says of this peer's averaging.
///
/// ```
/// use starling_averager::AveragerBoard;
/// let m = starling_node::metrics::Metrics::new();
/// m.set_section(&AveragerBoard { bandwidth: 1e8 });
/// assert_eq!(m.board().get::<AveragerBoard>().unwrap().bandwidth, 1e8);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AveragerBoard {
    /// Measured averaging bandwidth (upload), bytes per second (0: not measured).
    pub bandwidth: f64,
}

impl Section for AveragerBoard {
    const NAME: &'static str = "averager";
    const VERSION: u32 = 1;
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BytesLabels {
    protocol: &'static str,
    lane: &'static str,
    direction: &'static str,
}

/// The averager's metrics on one node (cheap to clone; clones share values).
#[derive(Clone)]
pub(crate) struct AveragerMetrics {
    rounds: Family<OutcomeLabels, Counter>,
    group_size: Histogram,
    bytes: Family<BytesLabels, Counter>,
    bandwidth: Gauge<f64, AtomicU64>,
    allreduce_seconds: Histogram,
    matchmaking_seconds: Histogram,
}

impl AveragerMetrics {
    /// The averager metrics of `node` (registered on first use).
    pub fn of(node: &Node) -> Self {
        node.metrics().component(|r: &mut Registry| {
            let m = AveragerMetrics {
                rounds: Family::default(),
                group_size: Histogram::new(exponential_buckets(1.0, 2.0, 8)),
                bytes: Family::default(),
                bandwidth: Gauge::default(),
                allreduce_seconds: Histogram::new(latency_buckets()),
                matchmaking_seconds: Histogram::new(latency_buckets()),
            };
            r.register(
                "averager_rounds",
                "Averaging steps by outcome: ok, partial (a member failed or spans stayed local), failed",
                m.rounds.clone(),
            );
            r.register(
                "averager_group_size",
                "Members per averaging round",
                m.group_size.clone(),
            );
            r.register_with_unit(
                "averager",
                "Span data moved, by protocol, lane (fast or libp2p) and direction",
                Unit::Bytes,
                m.bytes.clone(),
            );
            r.register(
                "averager_bandwidth_bytes_per_second",
                "The bandwidth this peer declares (its measured upload rate)",
                m.bandwidth.clone(),
            );
            r.register_with_unit(
                "averager_allreduce",
                "Time spent in the all-reduce of a round",
                Unit::Seconds,
                m.allreduce_seconds.clone(),
            );
            r.register_with_unit(
                "averager_matchmaking",
                "Time spent finding a group",
                Unit::Seconds,
                m.matchmaking_seconds.clone(),
            );
            m
        })
    }

    /// Records a step's outcome here and in the node's journal; `bandwidth` is the estimate
    /// after the step.
    pub fn record_step(
        &self,
        node: &Node,
        result: &Result<RoundReport, AveragerError>,
        bandwidth: f64,
    ) {
        let now = starling_dht::now_ms();
        let record = match result {
            Ok(r) => {
                let fraction = r.averaged_fraction();
                let all_averaged = r.spans.iter().all(|s| {
                    s.outcome
                        .contributors()
                        .is_some_and(|c| c.len() == r.group.len())
                });
                let outcome = if r.failed_peers.is_empty() && all_averaged {
                    "ok"
                } else {
                    "partial"
                };
                self.group_size.observe(r.group.len() as f64);
                self.allreduce_seconds
                    .observe(r.allreduce_time.as_secs_f64());
                self.matchmaking_seconds
                    .observe(r.matchmaking_time.as_secs_f64());
                RoundRecord {
                    time_ms: now,
                    round_id: r.round_id,
                    group_size: r.group.len(),
                    outcome: outcome.into(),
                    averaged_fraction: fraction,
                    bytes_sent: r.bytes_sent,
                    bytes_received: r.bytes_received,
                    allreduce_seconds: r.allreduce_time.as_secs_f64(),
                    error: None,
                }
            }
            Err(e) => RoundRecord {
                time_ms: now,
                round_id: 0,
                group_size: 0,
                outcome: "failed".into(),
                averaged_fraction: 0.0,
                bytes_sent: 0,
                bytes_received: 0,
                allreduce_seconds: 0.0,
                error: Some(e.to_string()),
            },
        };
        let outcome: &'static str = match record.outcome.as_str() {
            "ok" => "ok",
            "partial" => "partial",
            _ => "failed",
        };
        self.rounds.get_or_create(&OutcomeLabels { outcome }).inc();
        if bandwidth.is_finite() {
            self.bandwidth.set(bandwidth);
            node.metrics().set_section(&AveragerBoard { bandwidth });
        }
        node.metrics().journal::<RoundRecord>().push(record);
    }

    /// The byte counters of one protocol over one lane.
    pub fn lane_bytes(&self, protocol: &'static str, fast: bool) -> (Counter, Counter) {
        let lane = if fast { "fast" } else { "libp2p" };
        let c = |direction| {
            self.bytes
                .get_or_create(&BytesLabels {
                    protocol,
                    lane,
                    direction,
                })
                .clone()
        };
        (c("received"), c("sent"))
    }
}

/// A reader or writer that counts the bytes through it.
pub(crate) struct Counted<T> {
    inner: T,
    bytes: Counter,
}

impl<T> Counted<T> {
    pub fn new(inner: T, bytes: Counter) -> Self {
        Counted { inner, bytes }
    }

    /// The reader or writer inside.
    pub fn into_inner(self) -> T {
        self.inner
    }

    /// A look at the reader or writer inside.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.bytes.inc_by(*n as u64);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.bytes.inc_by(*n as u64);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}
