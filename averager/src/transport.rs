//! How this averager reaches other members: libp2p streams, fast lanes, dialing a member that
//! is not connected yet, and remembering peers whose fast lane failed. One cloneable
//! [`Transport`] serves matchmaking and every round.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{AsyncRead, AsyncWrite};
use starling_node::{FastStream, Multiaddr, Node, PeerId, Stream, StreamProtocol};
use tokio::time::{timeout, Instant};

use crate::metrics::{AveragerMetrics, Counted};
use crate::sync::lock;
use crate::AveragerError;

/// How long a peer whose fast lane failed is reached over libp2p streams only.
const LANE_RETRY_AFTER: Duration = Duration::from_secs(300);
/// Peers remembered as having no usable fast lane, at most.
const MAX_LANE_FAILURES: usize = 4096;

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
    pub fn split_counted(&self, lane: Lane, protocol: &'static str) -> (LaneReader, LaneWriter) {
        let (received, sent) = self.inner.metrics.lane_bytes(protocol, lane.is_fast());
        let (rd, wr) = lane.split();
        (
            Box::new(Counted::new(rd, received)),
            Box::new(Counted::new(wr, sent)),
        )
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

/// A reduce exchange's stream. Writes on a fast lane are buffered: the frame writers flush
/// where the peer must see what was written.
pub(crate) enum Lane {
    P2p(Stream),
    Fast(Box<FastStream>),
}

pub(crate) type LaneReader = Box<dyn AsyncRead + Send + Unpin>;
pub(crate) type LaneWriter = Box<dyn AsyncWrite + Send + Unpin>;

impl Lane {
    /// Read and write halves for concurrent use. A fast lane's halves are independent (each
    /// encrypts or decrypts in its own task); a libp2p stream's share a lock.
    pub fn split(self) -> (LaneReader, LaneWriter) {
        match self {
            Lane::P2p(s) => {
                let (r, w) = futures::AsyncReadExt::split(s);
                (Box::new(r), Box::new(w))
            }
            Lane::Fast(s) => {
                let (r, w) = (*s).into_split();
                (Box::new(r), Box::new(w))
            }
        }
    }

    pub fn is_fast(&self) -> bool {
        matches!(self, Lane::Fast(_))
    }
}

impl AsyncRead for Lane {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Lane::P2p(s) => Pin::new(s).poll_read(cx, buf),
            Lane::Fast(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Lane {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Lane::P2p(s) => Pin::new(s).poll_write(cx, buf),
            Lane::Fast(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Lane::P2p(s) => Pin::new(s).poll_flush(cx),
            Lane::Fast(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Lane::P2p(s) => Pin::new(s).poll_close(cx),
            Lane::Fast(s) => Pin::new(&mut **s).poll_close(cx),
        }
    }
}
