//! The fast lane: direct, encrypted TCP connections for bulk data between connected peers.
//!
//! A libp2p stream moves 300-400 MiB/s on loopback here: every byte goes through one noise
//! session (ChaCha20-Poly1305 in 64 KiB frames, about 1.2 GB/s per core) and yamux, inside the
//! one task that owns the connection. A fast lane connection is a plain TCP socket whose records
//! are sealed with AES-256-GCM (about 5 GB/s per core with AES-NI) in records of up to 256 KiB,
//! and each connection's reader and writer run in the caller's own tasks, so several transfers
//! encrypt on several cores at once.
//!
//! **Where it listens.** On every IP libp2p listens on for TCP: with the default
//! `/ip4/0.0.0.0/tcp/0` that is all interfaces, one port (`fast_lane_port` in
//! [`NodeConfig`](crate::NodeConfig), else chosen by the OS). Between machines that port must
//! be open, as libp2p's is; where it is not, transfers fall back to libp2p streams.
//!
//! **Trust comes from libp2p.** The dialer asks for a lane over an ordinary libp2p stream
//! (`/starling/fastlane/2`), which is already authenticated to the remote peer id (and, in a
//! private swarm, protected by the swarm key). In that request it sends a fresh random 128-bit
//! token and 256 bits of fresh randomness; the listener answers with its lane addresses and 256
//! bits of its own, and both derive the lane's two keys (one per direction) from both sides'
//! randomness with HKDF, so no dialer, broken or hostile, can make the listener reuse a key.
//! The dialer then opens TCP to the IP address of its libp2p connection at the port the answer
//! lists for that address, and sends the token and a first sealed record; the listener hands
//! the socket to the protocol's handler only once that record opens with the lane's key, and
//! answers READY only once the handler's queue has a place for it. Tokens are single-use and
//! expire within seconds; nobody who has not passed the libp2p handshake can obtain one, and a
//! stolen token is useless without the keys. Records carry a per-direction counter nonce, their
//! length is authenticated, and a stream ends with a sealed close record, so truncation is
//! detected too.
//!
//! **Nobody can starve it.** Connections that have not proven an offer get a short deadline
//! and bounded places, per source IP too, with room kept for IPs whose peers have offers
//! pending (see `listener`); offers are few, short-lived and shared fairly between peers (see
//! `offers`).
//!
//! Where no lane can be had (client-mode or firewalled listener, relayed connection, fast lane
//! disabled), [`Node::open_fast`](crate::Node::open_fast) fails quickly and callers fall back to
//! libp2p streams.

mod gate;
mod handshake;
mod listener;
mod offers;
mod record;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::AsyncWriteExt;
use libp2p::{PeerId, StreamProtocol};
use ring::rand::{SecureRandom, SystemRandom};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};
use tracing::Instrument;

use crate::framing::{read_msg, write_msg};
use crate::NodeError;
use gate::Gate;
use handshake::{derive_keys, lane_port, Handshake, Keys, Secret, Token, HELLO};
use handshake::{MAX_HANDSHAKE_MSG, READY};
pub(crate) use listener::lane_ips;
use listener::{MAX_UNAUTHENTICATED, MAX_UNAUTHENTICATED_PER_IP};
use offers::{Offers, Pending, MAX_PENDING, MAX_PENDING_PER_PEER, OFFER_LIFETIME};
use record::{open_greeting, seal_greeting, LaneGuard, GREETING};
pub use record::{FastReader, FastStream, FastWriter, MAX_RECORD};
use starling_dht::lock::lock;

/// The libp2p protocol on which fast lanes are requested.
pub const FASTLANE_PROTOCOL: StreamProtocol = StreamProtocol::new("/starling/fastlane/2");

/// Queued inbound lanes per protocol before new ones are refused.
const ROUTE_QUEUE: usize = 64;
/// Longest wait for a lane's TCP connection and handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Tries at a lane request whose stream was dropped.
const OFFER_ATTEMPTS: u32 = 4;
/// Pause before retrying a dropped lane request, times the number of the retry.
const OFFER_RETRY_PAUSE: Duration = Duration::from_millis(20);

/// Asks the swarm task for the IP of a peer's direct connection.
pub(crate) type PeerIpLookup =
    Arc<dyn Fn(PeerId) -> BoxFuture<'static, Option<IpAddr>> + Send + Sync>;

/// Inbound fast lanes for one protocol: `(remote peer, stream)` pairs, authenticated.
pub type IncomingFast = mpsc::Receiver<(PeerId, FastStream)>;

/// The node's fast lane state: the listeners (none in client mode), the routes that take
/// inbound lanes, offers waiting for their TCP connection, and the bounds on strangers.
pub(crate) struct FastLane {
    /// Where the lane listens (an unspecified IP: every interface); empty: dial only.
    addrs: Vec<SocketAddr>,
    timeout: Duration,
    route_queue: usize,
    routes: Mutex<HashMap<String, mpsc::Sender<(PeerId, FastStream)>>>,
    offers: Mutex<Offers>,
    /// Places for connections that have not proven an offer yet, by source IP.
    unauthenticated: Arc<Mutex<Gate<IpAddr>>>,
    peer_ip: Option<PeerIpLookup>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Every open lane, so that stopping the node cuts them all.
    live: Mutex<Vec<Weak<LaneGuard>>>,
    rng: SystemRandom,
    /// Reads on new lanes are held back this long (a simulation, see [`crate::simdelay`]).
    read_delay: Option<Duration>,
}

/// Unsent bytes a lane's socket holds before a write waits (`TCP_NOTSENT_LOWAT`), where the
/// OS has the option: a writer whose last byte was accepted has then sent all but about this
/// much (plus what is in flight), so a sender's timing of its writes measures its uplink. A
/// default socket buffer grows to 4 MiB and swallowed whole spans at once: on a 20 Mbit/s
/// uplink a 1 MiB span read as 6x faster than it went out, and the load balancer gave that
/// peer a share. It also keeps a control message written behind bulk data from queueing behind
/// megabytes. One record's worth, so the writer still has the next record ready in time.
const LANE_UNSENT_BYTES: u32 = 256 << 10;

fn limit_unsent(tcp: &TcpStream) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Err(e) = socket2::SockRef::from(tcp).set_tcp_notsent_lowat(LANE_UNSENT_BYTES) {
        tracing::debug!("TCP_NOTSENT_LOWAT not set on a lane: {e}");
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let _ = tcp;
}

impl FastLane {
    /// Wraps a socket whose greetings are done into a lane that [`Self::stop`] can cut.
    fn lane(&self, tcp: TcpStream, keys: &Keys, dialer: bool) -> io::Result<FastStream> {
        limit_unsent(&tcp);
        let std = tcp.into_std()?;
        let guard = Arc::new(LaneGuard(std.try_clone()?));
        let tcp = TcpStream::from_std(std)?;
        let mut live = lock(&self.live);
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(&guard));
        drop(live);
        FastStream::new(tcp, keys, dialer, 1, Some(guard), self.read_delay)
    }

    fn with_parts(
        addrs: Vec<SocketAddr>,
        timeout: Duration,
        route_queue: usize,
        peer_ip: Option<PeerIpLookup>,
        read_delay: Option<Duration>,
    ) -> Self {
        FastLane {
            addrs,
            timeout,
            route_queue,
            routes: Mutex::new(HashMap::new()),
            offers: Mutex::new(Offers::new(MAX_PENDING, MAX_PENDING_PER_PEER)),
            unauthenticated: Gate::new(MAX_UNAUTHENTICATED, MAX_UNAUTHENTICATED_PER_IP),
            peer_ip,
            tasks: Mutex::new(Vec::new()),
            live: Mutex::new(Vec::new()),
            rng: SystemRandom::new(),
            read_delay,
        }
    }

    /// A lane state that only dials (client mode). Its lanes hold back what they read by
    /// `read_delay` (`NodeConfig::simulated_rtt`'s half, a simulation: see [`crate::simdelay`]).
    pub(crate) fn dial_only(timeout: Duration, read_delay: Option<Duration>) -> Arc<Self> {
        Arc::new(Self::with_parts(
            Vec::new(),
            timeout,
            ROUTE_QUEUE,
            None,
            read_delay,
        ))
    }

    /// Binds a listener on each of `ips` (see [`lane_ips`]), all on `port` where possible,
    /// and starts the accept loops; `peer_ip` tells where an offering peer connects from. Its
    /// lanes hold back what they read by `read_delay` (see [`Self::dial_only`]).
    pub(crate) async fn listen(
        ips: &[IpAddr],
        port: u16,
        timeout: Duration,
        control: crate::StreamControl,
        peer_ip: PeerIpLookup,
        read_delay: Option<Duration>,
    ) -> Result<Arc<Self>, NodeError> {
        let listeners = listener::bind(ips, port)?;
        let addrs = listeners
            .iter()
            .map(|l| l.local_addr())
            .collect::<io::Result<Vec<_>>>()
            .map_err(|e| NodeError::Transport(e.to_string()))?;
        let lane = Arc::new(Self::with_parts(
            addrs.clone(),
            timeout,
            ROUTE_QUEUE,
            Some(peer_ip),
            read_delay,
        ));
        // The loops and the handshakes they spawn run in the caller's span (the node's).
        let offers = listener::serve_offers(Arc::downgrade(&lane), control);
        let mut tasks = vec![tokio::spawn(offers.in_current_span())];
        for l in listeners {
            let conns = listener::serve_connections(Arc::downgrade(&lane), l);
            tasks.push(tokio::spawn(conns.in_current_span()));
        }
        lock(&lane.tasks).extend(tasks);
        tracing::debug!(?addrs, "fast lane listening");
        Ok(lane)
    }

    /// The listener's TCP port (of its first address); `None` for a dial-only lane state.
    pub(crate) fn port(&self) -> Option<u16> {
        self.addrs.first().map(SocketAddr::port)
    }

    /// Where the lane listens; empty for a dial-only lane state.
    pub(crate) fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Stops the accept loops and drops every route (handlers see their incoming queue end).
    pub(crate) fn stop(&self) {
        for h in lock(&self.tasks).drain(..) {
            h.abort();
        }
        lock(&self.routes).clear();
        lock(&self.offers).clear();
        for g in lock(&self.live).drain(..).filter_map(|w| w.upgrade()) {
            let _ = g.0.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Takes inbound lanes for `protocol` (see [`crate::Node::accept_fast`]).
    pub(crate) fn accept(&self, protocol: &StreamProtocol) -> Result<IncomingFast, NodeError> {
        if self.addrs.is_empty() {
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
        let (tx, rx) = mpsc::channel(self.route_queue.max(1));
        routes.insert(key, tx);
        Ok(rx)
    }

    /// Requests and connects a lane to `peer` (reached at `ip`) for `protocol`.
    pub(crate) async fn open(
        &self,
        control: crate::StreamControl,
        peer: PeerId,
        ip: IpAddr,
        protocol: &StreamProtocol,
    ) -> Result<FastStream, NodeError> {
        let (token, keys, addrs) = self.request(control, peer, protocol).await?;
        let port = lane_port(ip, &addrs)
            .ok_or_else(|| NodeError::FastLane(format!("{peer} listed no lane address")))?;
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

    /// Offers `peer` a lane for `protocol` over a libp2p stream; returns the lane's token and
    /// keys, and the addresses the peer listens for lanes on.
    async fn request(
        &self,
        mut control: crate::StreamControl,
        peer: PeerId,
        protocol: &StreamProtocol,
    ) -> Result<(Token, Keys, Vec<SocketAddr>), NodeError> {
        // libp2p-stream drops inbound streams that arrive while the listener's accept queue is
        // busy (several peers asking at once): a dropped request is retried with fresh secrets.
        // Not `streams::open_confirmed`: it resends one fixed hello, but a retry must carry a
        // fresh token (an offer whose reply was lost is still pending on the listener, which
        // refuses the same token again as "in use"), and each attempt here gets the whole
        // request timeout rather than sharing one deadline.
        let mut attempt = 0u32;
        let (token, secret, reply) = loop {
            let (token, secret) = self.fresh_secrets()?;
            let offer = Handshake::Offer {
                protocol: protocol.as_ref().to_string(),
                token,
                secret,
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
                Ok(reply) => break (token, secret, reply),
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
            Handshake::Accept { addrs, random } => {
                let keys = derive_keys(&token, &secret, &random)
                    .map_err(|e| NodeError::FastLane(e.to_string()))?;
                Ok((token, keys, addrs))
            }
            Handshake::Refuse(why) => {
                Err(NodeError::FastLane(format!("{peer} refused a lane: {why}")))
            }
            Handshake::Offer { .. } => {
                Err(NodeError::FastLane(format!("{peer} answered out of turn")))
            }
        }
    }

    /// Fresh randomness: a single-use token and a key share.
    fn fresh_secrets(&self) -> Result<(Token, Secret), NodeError> {
        let mut token = [0u8; 16];
        let mut secret = [0u8; 32];
        self.rng
            .fill(&mut token)
            .and_then(|_| self.rng.fill(&mut secret))
            .map_err(|_| NodeError::FastLane("no randomness available".into()))?;
        Ok((token, secret))
    }

    /// Connects to an accepted offer's address and proves the offer: the token in the clear and
    /// HELLO sealed with the lane's key, in one write; the lane is ready once READY comes back.
    async fn connect(
        &self,
        addr: SocketAddr,
        token: &Token,
        keys: &Keys,
    ) -> io::Result<FastStream> {
        let mut tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let mut first = [0u8; 16 + GREETING];
        first[..16].copy_from_slice(token);
        first[16..].copy_from_slice(&seal_greeting(&keys[..32], HELLO)?);
        tcp.write_all(&first).await?;
        let mut answer = [0u8; GREETING];
        tcp.read_exact(&mut answer).await?;
        if &open_greeting(&keys[32..], &answer)? != READY {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad lane answer",
            ));
        }
        self.lane(tcp, keys, true)
    }

    /// The listener's answer to `peer`'s request (its libp2p connection comes from `ip`):
    /// accepts an offer, with fresh randomness of its own for the keys, and remembers it until
    /// its connection arrives or it lapses, when the protocol has a handler, the token is new
    /// and the peer holds no more than its share of pending offers.
    fn offer(&self, peer: PeerId, ip: Option<IpAddr>, msg: Handshake) -> Handshake {
        let Handshake::Offer {
            protocol,
            token,
            secret,
        } = msg
        else {
            return Handshake::Refuse("expected an offer".into());
        };
        if self.addrs.is_empty() {
            return Handshake::Refuse("no listener".into());
        }
        let routed = lock(&self.routes)
            .get(&protocol)
            .is_some_and(|tx| !tx.is_closed());
        if !routed {
            return Handshake::Refuse(format!("no handler for {protocol}"));
        }
        let mut random = [0u8; 32];
        if self.rng.fill(&mut random).is_err() {
            return Handshake::Refuse("no randomness available".into());
        }
        let Ok(keys) = derive_keys(&token, &secret, &random) else {
            return Handshake::Refuse("no keys".into());
        };
        let now = Instant::now();
        let pending = Pending {
            peer,
            ip,
            protocol,
            keys,
            expires: now + OFFER_LIFETIME,
        };
        match lock(&self.offers).insert(token, pending, now) {
            Ok(()) => Handshake::Accept {
                addrs: self.addrs.clone(),
                random,
            },
            Err(why) => Handshake::Refuse(why.to_string()),
        }
    }
}

/// The last handle gone (every `Node` clone dropped without `shutdown`): stop the loops too.
impl Drop for FastLane {
    fn drop(&mut self) {
        self.stop();
    }
}
