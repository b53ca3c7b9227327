//! How this averager reaches other members: libp2p streams, fast lanes, dialing a member that
//! is not connected yet, remembering peers whose fast lane failed, and keeping lanes warm
//! between rounds. One cloneable [`Transport`] serves matchmaking and every round.
//!
//! **Warm lanes.** A fresh fast lane costs three round trips before the first byte of data (the
//! libp2p offer, TCP's handshake, the lane's greeting) and then TCP slow start; on a slow or
//! busy link that is a large part of a small all-reduce. So a reduce exchange that ended cleanly
//! (the sender saw `ResultDone`, the reducer saw `SendDone`) keeps its lane: the sender in a
//! bounded pool here ([`Transport::keep_idle`]), the reducer parked on the router, waiting for
//! the next hello. The next round to the same reducer takes the pooled lane and pays one round
//! trip (its hello). Lanes are retired, and fresh keys made, after [`LANE_MAX_AGE`] or
//! [`LANE_MAX_RECORDS`] records; idle ones after [`LANE_IDLE_OUT`] (the reducer's parked end
//! waits longer, [`LANE_IDLE_IN`], so a sender never picks a lane whose other end just gave up
//! on it in the normal case; when it does, the hello fails and the sender opens a fresh lane).

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{AsyncRead, AsyncWrite};
use starling_node::{
    FastReader, FastStream, FastWriter, Multiaddr, Node, PeerId, Stream, StreamProtocol,
};
use tokio::time::{timeout, Instant};

use crate::metrics::{AveragerMetrics, Counted};
use crate::AveragerError;
use starling_node::lock::lock;

/// How long a peer whose fast lane failed is reached over libp2p streams only.
const LANE_RETRY_AFTER: Duration = Duration::from_secs(300);
/// Peers remembered as having no usable fast lane, at most.
const MAX_LANE_FAILURES: usize = 4096;
/// How long a sender keeps an idle lane for the next round.
pub(crate) const LANE_IDLE_OUT: Duration = Duration::from_secs(20);
/// How long a reducer's end of an idle lane waits for the next hello (longer than
/// [`LANE_IDLE_OUT`]).
pub(crate) const LANE_IDLE_IN: Duration = Duration::from_secs(30);
/// A lane older than this is not reused: the next round makes a fresh one, with fresh keys.
pub(crate) const LANE_MAX_AGE: Duration = Duration::from_secs(600);
/// A lane that carried this many records (256 KiB each at most) is not reused either.
pub(crate) const LANE_MAX_RECORDS: u64 = 1 << 20;
/// Idle lanes kept per peer (a round uses one per reducer; repairs may use another).
const MAX_IDLE_PER_PEER: usize = 2;
/// Idle lanes kept in all.
const MAX_IDLE: usize = 256;

/// An idle outbound lane and since when it is idle.
struct Idle {
    lane: FastStream,
    since: Instant,
}

/// Opens averaging streams to other members (cheap to clone).
#[derive(Clone)]
pub(crate) struct Transport {
    inner: Arc<Inner>,
}

struct Inner {
    node: Node,
    /// Whether span data may use fast lanes at all.
    fast_lane: bool,
    /// Bound on opening one stream.
    request_timeout: Duration,
    /// Peers whose fast lane failed recently, and when.
    lane_failures: Mutex<HashMap<PeerId, Instant>>,
    /// Idle outbound reduce lanes, by reducer, newest last.
    idle: Mutex<HashMap<PeerId, Vec<Idle>>>,
    /// Byte counters per protocol and lane.
    metrics: AveragerMetrics,
}

impl Transport {
    pub fn new(node: Node, fast_lane: bool, request_timeout: Duration) -> Self {
        Transport {
            inner: Arc::new(Inner {
                fast_lane,
                request_timeout,
                lane_failures: Mutex::new(HashMap::new()),
                idle: Mutex::new(HashMap::new()),
                metrics: AveragerMetrics::of(&node),
                node,
            }),
        }
    }

    /// The averager's metrics on this node.
    pub fn metrics(&self) -> &AveragerMetrics {
        &self.inner.metrics
    }

    /// [`Lane::split`], with every byte through either half counted in the averager's
    /// `bytes_total{protocol, lane, direction}`.
    pub fn split_counted(
        &self,
        lane: Lane,
        protocol: &'static str,
    ) -> (Counted<LaneReader>, Counted<LaneWriter>) {
        let (received, sent) = self.inner.metrics.lane_bytes(protocol, lane.is_fast());
        let (rd, wr) = lane.split();
        (Counted::new(rd, received), Counted::new(wr, sent))
    }

    /// A warm reduce lane to `peer` from the pool, if one is still good (see the module docs);
    /// lanes found stale on the way are dropped.
    pub fn take_idle(&self, peer: PeerId) -> Option<FastStream> {
        let mut idle = lock(&self.inner.idle);
        let lanes = idle.get_mut(&peer)?;
        let mut found = None;
        while let Some(mut kept) = lanes.pop() {
            if kept.since.elapsed() < LANE_IDLE_OUT && reusable(&mut kept.lane) {
                found = Some(kept.lane);
                break;
            }
        }
        if lanes.is_empty() {
            idle.remove(&peer);
        }
        found
    }

    /// Keeps a reduce lane whose exchange ended cleanly for the next round to `peer` (or drops
    /// it, which closes it, when it is too old or the pool is full).
    pub fn keep_idle(&self, peer: PeerId, mut lane: FastStream) {
        if !reusable(&mut lane) {
            return;
        }
        let mut idle = lock(&self.inner.idle);
        idle.retain(|_, lanes| {
            lanes.retain(|k| k.since.elapsed() < LANE_IDLE_OUT);
            !lanes.is_empty()
        });
        let total: usize = idle.values().map(Vec::len).sum();
        let lanes = idle.entry(peer).or_default();
        if total < MAX_IDLE && lanes.len() < MAX_IDLE_PER_PEER {
            lanes.push(Idle {
                lane,
                since: Instant::now(),
            });
        }
    }

    /// The node underneath.
    pub fn node(&self) -> &Node {
        &self.inner.node
    }

    /// Opens a libp2p stream to `peer`, dialing one of `addrs` first if the first attempt fails
    /// (the peer is not connected and libp2p knows no address for it).
    pub async fn open_stream(
        &self,
        peer: PeerId,
        addrs: &[Multiaddr],
        protocol: StreamProtocol,
    ) -> Result<Stream, AveragerError> {
        let t = self.inner.request_timeout;
        let mut control = self.inner.node.stream_control();
        if let Ok(Ok(s)) = timeout(t, control.open_stream(peer, protocol.clone())).await {
            return Ok(s);
        }
        self.inner.node.connect_if_needed(peer, addrs).await?;
        match timeout(t, control.open_stream(peer, protocol)).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(AveragerError::Protocol(format!(
                "cannot open a stream to {peer}: {e}"
            ))),
            Err(_) => Err(AveragerError::Deadline("while opening a stream")),
        }
    }

    /// Opens a reduce exchange's stream to `peer`: a fast lane if the configuration allows one
    /// and the peer's lane has not failed recently, else a libp2p stream.
    pub async fn open_lane(
        &self,
        peer: PeerId,
        addrs: &[Multiaddr],
        protocol: StreamProtocol,
    ) -> Result<Lane, AveragerError> {
        let inner = &self.inner;
        let recently_failed = lock(&inner.lane_failures)
            .get(&peer)
            .is_some_and(|at| at.elapsed() < LANE_RETRY_AFTER);
        if inner.fast_lane && !recently_failed {
            // A lane is asked for over a direct connection: make one if there is none yet. If
            // that fails, libp2p may still find a way (other addresses, a relay): no lane this
            // time, but that is no reason to stop asking the peer for one.
            let connected = inner.node.connect_if_needed(peer, addrs).await?;
            match inner.node.open_fast(peer, protocol.clone()).await {
                Ok(s) => return Ok(Lane::Fast(Box::new(s))),
                Err(e) if !connected => {
                    tracing::debug!(%peer, "not connected directly, no fast lane this time: {e}");
                }
                Err(e) => {
                    tracing::debug!(%peer, "no fast lane, using libp2p streams: {e}");
                    let mut f = lock(&inner.lane_failures);
                    f.retain(|_, at| at.elapsed() < LANE_RETRY_AFTER);
                    if f.len() < MAX_LANE_FAILURES {
                        f.insert(peer, Instant::now());
                    }
                }
            }
        }
        self.open_stream(peer, addrs, protocol).await.map(Lane::P2p)
    }
}

/// Whether a lane is young enough and not worn, so it may carry another exchange.
pub(crate) fn young(lane: &FastStream) -> bool {
    lane.age() < LANE_MAX_AGE && lane.records() < LANE_MAX_RECORDS
}

/// Whether an idle lane may carry another exchange: [`young`], and quiet and open.
fn reusable(lane: &mut FastStream) -> bool {
    young(lane) && lane.is_reusable()
}

/// A reduce exchange's stream. Writes on a fast lane are buffered: the frame writers flush
/// where the peer must see what was written.
pub(crate) enum Lane {
    P2p(Stream),
    Fast(Box<FastStream>),
}

/// A lane's read half.
pub(crate) enum LaneReader {
    P2p(futures::io::ReadHalf<Stream>),
    Fast(Box<FastReader>),
}

/// A lane's write half.
pub(crate) enum LaneWriter {
    P2p(futures::io::WriteHalf<Stream>),
    Fast(Box<FastWriter>),
}

impl Lane {
    /// Read and write halves for concurrent use. A fast lane's halves are independent (each
    /// encrypts or decrypts in its own task); a libp2p stream's share a lock.
    pub fn split(self) -> (LaneReader, LaneWriter) {
        match self {
            Lane::P2p(s) => {
                let (r, w) = futures::AsyncReadExt::split(s);
                (LaneReader::P2p(r), LaneWriter::P2p(w))
            }
            Lane::Fast(s) => {
                let (r, w) = (*s).into_split();
                (LaneReader::Fast(Box::new(r)), LaneWriter::Fast(Box::new(w)))
            }
        }
    }

    pub fn is_fast(&self) -> bool {
        matches!(self, Lane::Fast(_))
    }
}

/// The fast lane that `rd` and `wr` split from, whole again (to keep it warm); `None` for a
/// libp2p stream's halves or halves of different lanes.
pub(crate) fn unsplit_fast(rd: LaneReader, wr: LaneWriter) -> Option<FastStream> {
    match (rd, wr) {
        (LaneReader::Fast(r), LaneWriter::Fast(w)) => FastStream::unsplit(*r, *w).ok(),
        _ => None,
    }
}

/// `AsyncRead` for a lane enum whose `P2p` variant holds a libp2p side and whose `Fast` variant
/// a boxed fast lane side.
macro_rules! lane_read {
    ($t:ident) => {
        impl AsyncRead for $t {
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut [u8],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $t::P2p(s) => Pin::new(s).poll_read(cx, buf),
                    $t::Fast(s) => Pin::new(&mut **s).poll_read(cx, buf),
                }
            }
        }
    };
}

/// `AsyncWrite` for a lane enum, as [`lane_read`] does reads.
macro_rules! lane_write {
    ($t:ident) => {
        impl AsyncWrite for $t {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    $t::P2p(s) => Pin::new(s).poll_write(cx, buf),
                    $t::Fast(s) => Pin::new(&mut **s).poll_write(cx, buf),
                }
            }

            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $t::P2p(s) => Pin::new(s).poll_flush(cx),
                    $t::Fast(s) => Pin::new(&mut **s).poll_flush(cx),
                }
            }

            fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    $t::P2p(s) => Pin::new(s).poll_close(cx),
                    $t::Fast(s) => Pin::new(&mut **s).poll_close(cx),
                }
            }
        }
    };
}

lane_read!(Lane);
lane_write!(Lane);
lane_read!(LaneReader);
lane_write!(LaneWriter);
