//! The fast lane: direct, encrypted TCP connections for bulk data between connected peers.
//!
//! A libp2p stream moves 300-400 MiB/s on loopback here: every byte goes through one noise
//! session (ChaCha20-Poly1305 in 64 KiB frames, about 1.2 GB/s per core) and yamux, inside the
//! one task that owns the connection. A fast lane connection is a plain TCP socket whose records
//! are sealed with AES-256-GCM (about 5 GB/s per core with AES-NI) in records of up to 256 KiB,
//! and each connection's reader and writer run in the caller's own tasks, so several transfers
//! encrypt on several cores at once.
//!
//! **Trust comes from libp2p.** The dialer asks for a lane over an ordinary libp2p stream
//! (`/starling/fastlane/1`), which is already authenticated to the remote peer id (and, in a
//! private swarm, protected by the swarm key). In that request it sends a fresh random 128-bit
//! token and two fresh random 256-bit keys, one per direction; the listener answers with its
//! fast lane port. The dialer then opens TCP to the IP address of its libp2p connection, sends
//! the token and a first sealed record, and the listener hands the socket to the protocol's
//! handler only once that record opens with the offered key. Tokens are single-use and expire;
//! nobody who has not passed the libp2p handshake can obtain one, and a stolen token is useless
//! without the keys. Records carry a per-direction counter nonce, their length is authenticated,
//! and a stream ends with a sealed close record, so truncation is detected too.
//!
//! Where no lane can be had (client-mode or firewalled listener, relayed connection, fast lane
//! disabled), [`Node::open_fast`](crate::Node::open_fast) fails quickly and callers fall back to
//! libp2p streams.

mod handshake;
mod record;

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use libp2p::{PeerId, StreamProtocol};
use ring::rand::{SecureRandom, SystemRandom};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};
use tracing::Instrument;

use crate::framing::{read_msg, write_msg};
use crate::sync::lock;
use crate::NodeError;
use handshake::{Handshake, Keys, Token, HELLO, MAX_HANDSHAKE_MSG, READY};
use record::LaneGuard;
pub use record::{FastReader, FastStream, FastWriter, MAX_RECORD};

/// The libp2p protocol on which fast lanes are requested.
pub const FASTLANE_PROTOCOL: StreamProtocol = StreamProtocol::new("/starling/fastlane/1");

/// Lanes offered but not yet connected, at most.
const MAX_PENDING: usize = 256;
/// Offers one peer may have pending (so that one peer cannot take every slot).
const MAX_PENDING_PER_PEER: usize = 32;
/// Handshakes in progress at most, per accept loop (offer streams; unauthenticated TCP
/// connections); more are dropped.
const MAX_HANDSHAKES: usize = 64;
/// Queued inbound lanes per protocol before new ones are refused.
const ROUTE_QUEUE: usize = 64;
/// Longest wait for a lane's TCP connection and handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Tries at a lane request whose stream was dropped.
const OFFER_ATTEMPTS: u32 = 4;
/// Pause before retrying a dropped lane request, times the number of the retry.
const OFFER_RETRY_PAUSE: Duration = Duration::from_millis(20);

/// A lane offered and accepted, waiting for its TCP connection.
struct Pending {
    peer: PeerId,
    protocol: String,
    keys: Keys,
    expires: Instant,
}

/// Inbound fast lanes for one protocol: `(remote peer, stream)` pairs, authenticated.
pub type IncomingFast = mpsc::Receiver<(PeerId, FastStream)>;

/// The node's fast lane state: the listener (absent in client mode), the routes that take
/// inbound lanes, and offers waiting for their TCP connection.
pub(crate) struct FastLane {
    port: Option<u16>,
    timeout: Duration,
    routes: Mutex<HashMap<String, mpsc::Sender<(PeerId, FastStream)>>>,
    pending: Mutex<HashMap<Token, Pending>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Every open lane, so that stopping the node cuts them all.
    live: Mutex<Vec<Weak<LaneGuard>>>,
    rng: SystemRandom,
}

impl FastLane {
    /// Wraps a connected socket into a lane that [`Self::stop`] can cut.
    fn lane(&self, tcp: TcpStream, keys: &Keys, dialer: bool) -> io::Result<FastStream> {
        let std = tcp.into_std()?;
        let guard = Arc::new(LaneGuard(std.try_clone()?));
        let tcp = TcpStream::from_std(std)?;
        let mut live = lock(&self.live);
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(&guard));
        drop(live);
        FastStream::new(tcp, keys, dialer, Some(guard))
    }

    fn with_port(port: Option<u16>, timeout: Duration) -> Arc<Self> {
        Arc::new(FastLane {
            port,
            timeout,
            routes: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            tasks: Mutex::new(Vec::new()),
            live: Mutex::new(Vec::new()),
            rng: SystemRandom::new(),
        })
    }

    /// A lane state that only dials (client mode).
    pub(crate) fn dial_only(timeout: Duration) -> Arc<Self> {
        Self::with_port(None, timeout)
    }

    /// Binds the listener on `ip:port` and starts its accept loops.
    pub(crate) async fn listen(
        ip: IpAddr,
        port: u16,
        timeout: Duration,
        control: libp2p_stream::Control,
    ) -> Result<Arc<Self>, NodeError> {
        let listener = TcpListener::bind(SocketAddr::new(ip, port))
            .await
            .map_err(|e| NodeError::Listen {
                addr: format!("{ip}:{port} (fast lane)"),
                reason: e.to_string(),
            })?;
        let port = listener
            .local_addr()
            .map_err(|e| NodeError::Transport(e.to_string()))?
            .port();
        let lane = Self::with_port(Some(port), timeout);
        // The loops and the handshakes they spawn run in the caller's span (the node's).
        let offers = tokio::spawn(serve_offers(Arc::downgrade(&lane), control).in_current_span());
        let conns =
            tokio::spawn(serve_connections(Arc::downgrade(&lane), listener).in_current_span());
        lock(&lane.tasks).extend([offers, conns]);
        tracing::debug!(port, "fast lane listening");
        Ok(lane)
    }

    /// The listener's TCP port; `None` for a dial-only lane state.
    pub(crate) fn port(&self) -> Option<u16> {
        self.port
    }

    /// Stops the accept loops and drops every route (handlers see their incoming queue end).
    pub(crate) fn stop(&self) {
        for h in lock(&self.tasks).drain(..) {
            h.abort();
        }
        lock(&self.routes).clear();
        lock(&self.pending).clear();
        for g in lock(&self.live).drain(..).filter_map(|w| w.upgrade()) {
            let _ = g.0.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Takes inbound lanes for `protocol` (see [`crate::Node::accept_fast`]).
    pub(crate) fn accept(&self, protocol: &StreamProtocol) -> Result<IncomingFast, NodeError> {
        if self.port.is_none() {
            return Err(NodeError::FastLane(
                "this node has no fast lane listener (client mode or disabled)".into(),
            ));
        }
        let mut routes = lock(&self.routes);
        let key = protocol.as_ref().to_string();
        if routes.get(&key).is_some_and(|tx| !tx.is_closed()) {
            return Err(NodeError::FastLane(format!(
                "{key} already has a fast lane handler"
            )));
        }
        let (tx, rx) = mpsc::channel(ROUTE_QUEUE);
        routes.insert(key, tx);
        Ok(rx)
    }

    /// Requests and connects a lane to `peer` (reached at `ip`) for `protocol`.
    pub(crate) async fn open(
        &self,
        control: libp2p_stream::Control,
        peer: PeerId,
        ip: IpAddr,
        protocol: &StreamProtocol,
    ) -> Result<FastStream, NodeError> {
        let (token, keys, port) = self.request(control, peer, protocol).await?;
        let addr = SocketAddr::new(ip, port);
        // A firewalled lane port drops the SYN: give up soon, the caller falls back to libp2p.
        timeout(
            self.timeout.min(CONNECT_TIMEOUT),
            self.connect(addr, &token, &keys),
        )
        .await
        .map_err(|_| NodeError::Timeout("connecting a fast lane"))?
        .map_err(|e| NodeError::FastLane(format!("fast lane to {addr} with {peer}: {e}")))
    }

    /// Offers `peer` a lane for `protocol` over a libp2p stream; returns the offer's secrets
    /// and the port the peer accepted it on.
    async fn request(
        &self,
        mut control: libp2p_stream::Control,
        peer: PeerId,
        protocol: &StreamProtocol,
    ) -> Result<(Token, Keys, u16), NodeError> {
        // libp2p-stream drops inbound streams that arrive while the listener's accept queue is
        // busy (several peers asking at once): a dropped request is retried with fresh secrets.
        // Not `streams::open_confirmed`: it resends one fixed hello, but a retry must carry a
        // fresh token (an offer whose reply was lost is still pending on the listener, which
        // refuses the same token again as "in use"), and each attempt here gets the whole
        // request timeout rather than sharing one deadline.
        let mut attempt = 0u32;
        let (token, keys, reply) = loop {
            let (token, keys) = self.fresh_secrets()?;
            let offer = Handshake::Offer {
                protocol: protocol.as_ref().to_string(),
                token,
                keys,
            };
            let asked = timeout(self.timeout, async {
                let mut s = control
                    .open_stream(peer, FASTLANE_PROTOCOL)
                    .await
                    .map_err(io::Error::other)?;
                write_msg(&mut s, &offer).await?;
                let reply: Handshake = read_msg(&mut s, MAX_HANDSHAKE_MSG).await?;
                let _ = s.close().await;
                Ok::<_, io::Error>(reply)
            })
            .await
            .map_err(|_| NodeError::Timeout("requesting a fast lane"))?;
            match asked {
                Ok(reply) => break (token, keys, reply),
                Err(e) if attempt + 1 < OFFER_ATTEMPTS => {
                    tracing::debug!(%peer, attempt, "fast lane request dropped, retrying: {e}");
                    attempt += 1;
                    tokio::time::sleep(OFFER_RETRY_PAUSE * attempt).await;
                }
                Err(e) => {
                    return Err(NodeError::FastLane(format!(
                        "requesting a fast lane with {peer}: {e}"
                    )))
                }
            }
        };
        match reply {
            Handshake::Accept { port } => Ok((token, keys, port)),
            Handshake::Refuse(why) => {
                Err(NodeError::FastLane(format!("{peer} refused a lane: {why}")))
            }
            Handshake::Offer { .. } => {
                Err(NodeError::FastLane(format!("{peer} answered out of turn")))
            }
        }
    }

    /// A fresh single-use token and a fresh key per direction.
    fn fresh_secrets(&self) -> Result<(Token, Keys), NodeError> {
        let mut token = [0u8; 16];
        let mut keys = [0u8; 64];
        self.rng
            .fill(&mut token)
            .and_then(|_| self.rng.fill(&mut keys))
            .map_err(|_| NodeError::FastLane("no randomness available".into()))?;
        Ok((token, keys))
    }

    /// Connects to an accepted offer's port and proves the offer: the token in the clear, then
    /// HELLO sealed with the offered key; the lane is ready once READY comes back.
    async fn connect(
        &self,
        addr: SocketAddr,
        token: &Token,
        keys: &Keys,
    ) -> io::Result<FastStream> {
        let mut tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        tokio::io::AsyncWriteExt::write_all(&mut tcp, token).await?;
        let mut lane = self.lane(tcp, keys, true)?;
        lane.write_all(HELLO).await?;
        lane.flush().await?;
        let mut ok = [0u8; 16];
        lane.read_exact(&mut ok).await?;
        if &ok != READY {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad lane answer",
            ));
        }
        Ok(lane)
    }

    /// The listener's answer to `peer`'s request: accepts an offer (and remembers it until its
    /// connection arrives or it expires) when the protocol has a handler, the token is new and
    /// neither the peer nor the node has too many offers pending.
    fn offer(&self, peer: PeerId, msg: Handshake) -> Handshake {
        let Handshake::Offer {
            protocol,
            token,
            keys,
        } = msg
        else {
            return Handshake::Refuse("expected an offer".into());
        };
        let Some(port) = self.port else {
            return Handshake::Refuse("no listener".into());
        };
        let routed = lock(&self.routes)
            .get(&protocol)
            .is_some_and(|tx| !tx.is_closed());
        if !routed {
            return Handshake::Refuse(format!("no handler for {protocol}"));
        }
        let mut pending = lock(&self.pending);
        let now = Instant::now();
        pending.retain(|_, p| p.expires > now);
        if pending.len() >= MAX_PENDING
            || pending.values().filter(|p| p.peer == peer).count() >= MAX_PENDING_PER_PEER
        {
            return Handshake::Refuse("too many lanes pending".into());
        }
        if pending.contains_key(&token) {
            return Handshake::Refuse("token in use".into());
        }
        pending.insert(
            token,
            Pending {
                peer,
                protocol,
                keys,
                expires: now + self.timeout,
            },
        );
        Handshake::Accept { port }
    }

    /// Authenticates one inbound TCP connection and routes it to its protocol's handler.
    async fn admit(&self, mut tcp: TcpStream) -> io::Result<()> {
        tcp.set_nodelay(true)?;
        let mut token = [0u8; 16];
        tokio::io::AsyncReadExt::read_exact(&mut tcp, &mut token).await?;
        let found = lock(&self.pending)
            .get(&token)
            .filter(|p| p.expires > Instant::now())
            .map(|p| (p.peer, p.protocol.clone(), p.keys));
        let Some((peer, protocol, keys)) = found else {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "unknown token",
            ));
        };
        let mut lane = self.lane(tcp, &keys, false)?;
        let mut hello = [0u8; 16];
        lane.read_exact(&mut hello).await?;
        if &hello != HELLO {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "bad lane hello"));
        }
        // The first record opened with the offered key: the dialer is who the offer came from.
        let fresh = lock(&self.pending).remove(&token).is_some();
        if !fresh {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "token used",
            ));
        }
        let route = lock(&self.routes).get(&protocol).cloned();
        let Some(route) = route else {
            return Err(io::Error::other("handler gone"));
        };
        lane.write_all(READY).await?;
        lane.flush().await?;
        route
            .try_send((peer, lane))
            .map_err(|_| io::Error::other("handler queue full"))
    }
}

/// The last handle gone (every `Node` clone dropped without `shutdown`): stop the loops too.
impl Drop for FastLane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Answers lane requests on [`FASTLANE_PROTOCOL`] streams until the lane state is gone.
async fn serve_offers(lane: std::sync::Weak<FastLane>, mut control: libp2p_stream::Control) {
    let Ok(mut incoming) = control.accept(FASTLANE_PROTOCOL) else {
        tracing::warn!("fast lane protocol already registered; lanes disabled");
        return;
    };
    let limit = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    while let Some((peer, mut stream)) = incoming.next().await {
        let Some(lane) = lane.upgrade() else { return };
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            continue;
        };
        let handshake = async move {
            let _permit = permit;
            let t = lane.timeout;
            let _ = timeout(t, async {
                let msg = read_msg(&mut stream, MAX_HANDSHAKE_MSG).await?;
                let reply = lane.offer(peer, msg);
                write_msg(&mut stream, &reply).await?;
                stream.close().await
            })
            .await;
        }
        .in_current_span();
        tokio::spawn(handshake);
    }
}

/// Accepts TCP connections on the lane port and admits those that prove an offer.
async fn serve_connections(lane: std::sync::Weak<FastLane>, listener: TcpListener) {
    let limit = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let (tcp, from) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!("fast lane accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(lane) = lane.upgrade() else { return };
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            continue; // dropped: too many unauthenticated connections at once
        };
        let handshake = async move {
            let _permit = permit;
            match timeout(lane.timeout, lane.admit(tcp)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(%from, "fast lane refused: {e}"),
                Err(_) => tracing::debug!(%from, "fast lane handshake timed out"),
            }
        }
        .in_current_span();
        tokio::spawn(handshake);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn offers_are_bounded_per_peer_and_tokens_are_single_use() {
        let lane = FastLane::with_port(Some(9), Duration::from_secs(5));
        let proto = StreamProtocol::new("/test/1");
        let _rx = lane.accept(&proto).unwrap();
        let offer = |i: u8| Handshake::Offer {
            protocol: "/test/1".into(),
            token: [i; 16],
            keys: [0; 64],
        };
        let (greedy, other) = (PeerId::random(), PeerId::random());
        for i in 0..MAX_PENDING_PER_PEER as u8 {
            assert!(matches!(
                lane.offer(greedy, offer(i)),
                Handshake::Accept { port: 9 }
            ));
        }
        assert!(matches!(
            lane.offer(greedy, offer(200)),
            Handshake::Refuse(_)
        ));
        // Another peer is not locked out, but cannot reuse a pending token.
        assert!(matches!(
            lane.offer(other, offer(201)),
            Handshake::Accept { .. }
        ));
        assert!(matches!(lane.offer(other, offer(0)), Handshake::Refuse(_)));
        // No handler for the protocol: refused.
        let mut stray = offer(202);
        if let Handshake::Offer { protocol, .. } = &mut stray {
            *protocol = "/nobody/1".into();
        }
        assert!(matches!(lane.offer(other, stray), Handshake::Refuse(_)));
    }
}
