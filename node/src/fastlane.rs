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

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, StreamExt};
use libp2p::{PeerId, StreamProtocol};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};
use tokio::io::ReadBuf;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};

use crate::NodeError;

/// The libp2p protocol on which fast lanes are requested.
pub const FASTLANE_PROTOCOL: StreamProtocol = StreamProtocol::new("/starling/fastlane/1");

/// Largest plaintext in one record. Small enough that a record stays in L2 while it is copied
/// and sealed, large enough that per-record costs vanish.
pub const MAX_RECORD: usize = 256 * 1024;
const HEAD: usize = 4;
const TAG: usize = 16;
/// Set in a record's length word for the (empty) record that ends a stream.
const CLOSE_BIT: u32 = 1 << 31;
/// What the dialer's first record says; what the listener's first record answers.
const HELLO: &[u8; 16] = b"starling-lane-v1";
const READY: &[u8; 16] = b"starling-lane-ok";
/// Lanes offered but not yet connected, and handshakes in progress, at most.
const MAX_PENDING: usize = 256;
/// Offers one peer may have pending (so that one peer cannot take every slot).
const MAX_PENDING_PER_PEER: usize = 32;
const MAX_HANDSHAKES: usize = 64;
/// Queued inbound lanes per protocol before new ones are refused.
const ROUTE_QUEUE: usize = 64;
const MAX_HANDSHAKE_MSG: usize = 1024;
/// Longest wait for a lane's TCP connection and handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Tries at a lane request whose stream was dropped, and the pause between them (times the try).
const OFFER_ATTEMPTS: u32 = 4;
const OFFER_RETRY_PAUSE: Duration = Duration::from_millis(20);

type Token = [u8; 16];
type Keys = [u8; 64];

#[derive(Serialize, Deserialize, Debug)]
enum Handshake {
    /// Dialer → listener: a lane for `protocol`, named by `token`; `keys` holds the
    /// dialer→listener key, then the listener→dialer key.
    Offer {
        protocol: String,
        token: Token,
        #[serde(with = "serde_bytes_64")]
        keys: Keys,
    },
    /// Listener → dialer: connect to this port within the offer's lifetime.
    Accept { port: u16 },
    /// Listener → dialer: no lane (reason for the log).
    Refuse(String),
}

mod serde_bytes_64 {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    pub fn serialize<S: Serializer>(v: &[u8; 64], s: S) -> Result<S::Ok, S::Error> {
        v.as_slice().serialize(s)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 64], D::Error> {
        let v = <Vec<u8>>::deserialize(d)?;
        v.try_into()
            .map_err(|_| serde::de::Error::custom("expected 64 key bytes"))
    }
}

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

/// Held by both halves of a lane: a second handle on its socket, through which
/// [`FastLane::stop`] shuts the connection down (what a killed node's connections do).
struct LaneGuard(std::net::TcpStream);

impl FastLane {
    fn lane(&self, tcp: TcpStream, keys: &Keys, dialer: bool) -> io::Result<FastStream> {
        let std = tcp.into_std()?;
        let guard = Arc::new(LaneGuard(std.try_clone()?));
        let tcp = TcpStream::from_std(std)?;
        if let Ok(mut live) = self.live.lock() {
            live.retain(|w| w.strong_count() > 0);
            live.push(Arc::downgrade(&guard));
        }
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
        let offers = tokio::spawn(serve_offers(Arc::downgrade(&lane), control));
        let conns = tokio::spawn(serve_connections(Arc::downgrade(&lane), listener));
        if let Ok(mut t) = lane.tasks.lock() {
            t.push(offers);
            t.push(conns);
        }
        tracing::debug!(port, "fast lane listening");
        Ok(lane)
    }

    pub(crate) fn port(&self) -> Option<u16> {
        self.port
    }

    /// Stops the accept loops and drops every route (handlers see their incoming queue end).
    pub(crate) fn stop(&self) {
        if let Ok(mut t) = self.tasks.lock() {
            for h in t.drain(..) {
                h.abort();
            }
        }
        if let Ok(mut r) = self.routes.lock() {
            r.clear();
        }
        if let Ok(mut p) = self.pending.lock() {
            p.clear();
        }
        if let Ok(mut live) = self.live.lock() {
            for g in live.drain(..).filter_map(|w| w.upgrade()) {
                let _ = g.0.shutdown(std::net::Shutdown::Both);
            }
        }
    }

    pub(crate) fn accept(&self, protocol: &StreamProtocol) -> Result<IncomingFast, NodeError> {
        if self.port.is_none() {
            return Err(NodeError::FastLane(
                "this node has no fast lane listener (client mode or disabled)".into(),
            ));
        }
        let mut routes = self
            .routes
            .lock()
            .map_err(|_| NodeError::FastLane("lock poisoned".into()))?;
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
        mut control: libp2p_stream::Control,
        peer: PeerId,
        ip: IpAddr,
        protocol: &StreamProtocol,
    ) -> Result<FastStream, NodeError> {
        let t = self.timeout;
        let err = |what: &str, e: &dyn std::fmt::Display| {
            NodeError::FastLane(format!("{what} with {peer}: {e}"))
        };
        // libp2p-stream drops inbound streams that arrive while the listener's accept queue is
        // busy (several peers asking at once): a dropped request is retried with fresh secrets.
        let mut attempt = 0u32;
        let (token, keys, reply) = loop {
            let mut token = [0u8; 16];
            let mut keys = [0u8; 64];
            self.rng
                .fill(&mut token)
                .and_then(|_| self.rng.fill(&mut keys))
                .map_err(|_| NodeError::FastLane("no randomness available".into()))?;
            let offer = Handshake::Offer {
                protocol: protocol.as_ref().to_string(),
                token,
                keys,
            };
            let asked = timeout(t, async {
                let mut s = control
                    .open_stream(peer, FASTLANE_PROTOCOL)
                    .await
                    .map_err(io::Error::other)?;
                write_msg(&mut s, &offer).await?;
                let reply = read_msg(&mut s).await?;
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
                Err(e) => return Err(err("requesting a fast lane", &e)),
            }
        };
        let port = match reply {
            Handshake::Accept { port } => port,
            Handshake::Refuse(why) => {
                return Err(NodeError::FastLane(format!("{peer} refused a lane: {why}")))
            }
            Handshake::Offer { .. } => {
                return Err(NodeError::FastLane(format!("{peer} answered out of turn")))
            }
        };
        let addr = SocketAddr::new(ip, port);
        let connect = async {
            let mut tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            tokio::io::AsyncWriteExt::write_all(&mut tcp, &token).await?;
            let mut lane = self.lane(tcp, &keys, true)?;
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
            Ok::<_, io::Error>(lane)
        };
        // A firewalled lane port drops the SYN: give up soon, the caller falls back to libp2p.
        timeout(t.min(CONNECT_TIMEOUT), connect)
            .await
            .map_err(|_| NodeError::Timeout("connecting a fast lane"))?
            .map_err(|e| err(&format!("fast lane to {addr}"), &e))
    }

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
        let routed = self
            .routes
            .lock()
            .is_ok_and(|r| r.get(&protocol).is_some_and(|tx| !tx.is_closed()));
        if !routed {
            return Handshake::Refuse(format!("no handler for {protocol}"));
        }
        let Ok(mut pending) = self.pending.lock() else {
            return Handshake::Refuse("internal error".into());
        };
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
        let found = self.pending.lock().ok().and_then(|p| {
            p.get(&token)
                .filter(|p| p.expires > Instant::now())
                .map(|p| (p.peer, p.protocol.clone(), p.keys))
        });
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
        let fresh = self
            .pending
            .lock()
            .is_ok_and(|mut p| p.remove(&token).is_some());
        if !fresh {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "token used",
            ));
        }
        let route = self
            .routes
            .lock()
            .ok()
            .and_then(|r| r.get(&protocol).cloned());
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
        tokio::spawn(async move {
            let _permit = permit;
            let t = lane.timeout;
            let _ = timeout(t, async {
                let msg = read_msg(&mut stream).await?;
                let reply = lane.offer(peer, msg);
                write_msg(&mut stream, &reply).await?;
                stream.close().await
            })
            .await;
        });
    }
}

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
        tokio::spawn(async move {
            let _permit = permit;
            match timeout(lane.timeout, lane.admit(tcp)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(%from, "fast lane refused: {e}"),
                Err(_) => tracing::debug!(%from, "fast lane handshake timed out"),
            }
        });
    }
}

async fn write_msg<S: AsyncWrite + Unpin>(s: &mut S, msg: &Handshake) -> io::Result<()> {
    let body = postcard::to_stdvec(msg).map_err(io::Error::other)?;
    s.write_all(&(body.len() as u32).to_le_bytes()).await?;
    s.write_all(&body).await?;
    s.flush().await
}

async fn read_msg<S: AsyncRead + Unpin>(s: &mut S) -> io::Result<Handshake> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_HANDSHAKE_MSG {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "handshake too large",
        ));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await?;
    postcard::from_bytes(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

fn key(bytes: &[u8]) -> io::Result<LessSafeKey> {
    UnboundKey::new(&AES_256_GCM, bytes)
        .map(LessSafeKey::new)
        .map_err(|_| io::Error::other("bad key"))
}

fn bad(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// An authenticated, encrypted, full-duplex byte stream to one peer (see the module docs).
/// Writes are buffered into records: call `flush` when the peer must see what was written, and
/// `close` to end the stream (a stream dropped without `close` reads as truncated on the other
/// side). [`FastStream::into_split`] gives halves that work in separate tasks.
pub struct FastStream {
    rd: FastReader,
    wr: FastWriter,
}

impl std::fmt::Debug for FastStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastStream").finish_non_exhaustive()
    }
}

impl FastStream {
    fn new(
        tcp: TcpStream,
        keys: &Keys,
        dialer: bool,
        guard: Option<Arc<LaneGuard>>,
    ) -> io::Result<Self> {
        let (out, inn) = if dialer {
            (&keys[..32], &keys[32..])
        } else {
            (&keys[32..], &keys[..32])
        };
        let (r, w) = tcp.into_split();
        Ok(FastStream {
            rd: FastReader {
                io: r,
                key: key(inn)?,
                counter: 0,
                buf: vec![0u8; 2 * (HEAD + MAX_RECORD + TAG)],
                raw: 0..0,
                plain: 0..0,
                closed: false,
                _guard: guard.clone(),
            },
            wr: FastWriter {
                io: w,
                key: key(out)?,
                counter: 0,
                buf: vec![0u8; HEAD],
                sealed: false,
                written: 0,
                close_sealed: false,
                _guard: guard,
            },
        })
    }

    /// The read and write halves, each usable from its own task.
    pub fn into_split(self) -> (FastReader, FastWriter) {
        (self.rd, self.wr)
    }
}

/// The receiving half of a [`FastStream`].
pub struct FastReader {
    io: OwnedReadHalf,
    key: LessSafeKey,
    counter: u64,
    buf: Vec<u8>,
    /// Received bytes not yet opened.
    raw: Range<usize>,
    /// Opened plaintext not yet handed out.
    plain: Range<usize>,
    closed: bool,
    _guard: Option<Arc<LaneGuard>>,
}

impl FastReader {
    /// Opens the next whole record in `raw`, if there is one.
    fn open_record(&mut self) -> io::Result<bool> {
        if self.raw.len() < HEAD {
            return Ok(false);
        }
        let at = self.raw.start;
        let head: [u8; 4] = self.buf[at..at + HEAD].try_into().expect("4 bytes");
        let word = u32::from_le_bytes(head);
        let close = word & CLOSE_BIT != 0;
        let len = (word & !CLOSE_BIT) as usize;
        if len > MAX_RECORD || (close && len != 0) {
            return Err(bad("malformed fast lane record"));
        }
        let total = HEAD + len + TAG;
        if self.raw.len() < total {
            return Ok(false);
        }
        let body = &mut self.buf[at + HEAD..at + total];
        self.key
            .open_in_place(nonce(self.counter), Aad::from(head), body)
            .map_err(|_| bad("fast lane record failed authentication"))?;
        self.counter += 1;
        self.plain = at + HEAD..at + HEAD + len;
        self.raw.start += total;
        self.closed = close;
        Ok(true)
    }
}

impl AsyncRead for FastReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            if !this.plain.is_empty() {
                let n = this.plain.len().min(out.len());
                out[..n].copy_from_slice(&this.buf[this.plain.start..this.plain.start + n]);
                this.plain.start += n;
                return Poll::Ready(Ok(n));
            }
            if this.closed || out.is_empty() {
                return Poll::Ready(Ok(0));
            }
            if this.open_record()? {
                continue;
            }
            // Make room for a whole record behind the bytes we have (nothing is handed out).
            if this.raw.is_empty() {
                this.raw = 0..0;
            } else if this.buf.len() - this.raw.start < HEAD + MAX_RECORD + TAG {
                let r = this.raw.clone();
                this.buf.copy_within(r.clone(), 0);
                this.raw = 0..r.len();
            }
            let end = this.raw.end;
            let mut rb = ReadBuf::new(&mut this.buf[end..]);
            ready!(tokio::io::AsyncRead::poll_read(
                Pin::new(&mut this.io),
                cx,
                &mut rb
            ))?;
            let n = rb.filled().len();
            if n == 0 {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "fast lane closed without its close record",
                )));
            }
            this.raw.end += n;
        }
    }
}

/// The sending half of a [`FastStream`].
pub struct FastWriter {
    io: OwnedWriteHalf,
    key: LessSafeKey,
    counter: u64,
    /// `[length word][plaintext]`, then, once sealed, `[ciphertext][tag]`.
    buf: Vec<u8>,
    sealed: bool,
    written: usize,
    close_sealed: bool,
    _guard: Option<Arc<LaneGuard>>,
}

/// Seals `buf` (`[length word][plaintext]`) in place into a record:
/// `[length word][ciphertext][tag]`.
fn seal_record(key: &LessSafeKey, counter: u64, buf: &mut Vec<u8>, close: bool) -> io::Result<()> {
    let len = buf.len() - HEAD;
    let word = len as u32 | if close { CLOSE_BIT } else { 0 };
    let head = word.to_le_bytes();
    buf[..HEAD].copy_from_slice(&head);
    let tag = key
        .seal_in_place_separate_tag(nonce(counter), Aad::from(head), &mut buf[HEAD..])
        .map_err(|_| io::Error::other("sealing failed"))?;
    buf.extend_from_slice(tag.as_ref());
    Ok(())
}

impl FastWriter {
    fn seal(&mut self, close: bool) -> io::Result<()> {
        seal_record(&self.key, self.counter, &mut self.buf, close)?;
        self.counter += 1;
        self.sealed = true;
        self.written = 0;
        Ok(())
    }

    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sealed {
            let n = ready!(tokio::io::AsyncWrite::poll_write(
                Pin::new(&mut self.io),
                cx,
                &self.buf[self.written..]
            ))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
            if self.written == self.buf.len() {
                self.sealed = false;
                self.buf.truncate(HEAD);
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for FastWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.close_sealed {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        ready!(this.poll_drain(cx))?;
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let room = MAX_RECORD - (this.buf.len() - HEAD);
        let n = room.min(data.len());
        this.buf.extend_from_slice(&data[..n]);
        if this.buf.len() - HEAD == MAX_RECORD {
            this.seal(false)?;
            // Start sending now; what is left goes out on the next write or flush.
            if let Poll::Ready(Err(e)) = this.poll_drain(cx) {
                return Poll::Ready(Err(e));
            }
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        if this.buf.len() > HEAD {
            this.seal(false)?;
            ready!(this.poll_drain(cx))?;
        }
        tokio::io::AsyncWrite::poll_flush(Pin::new(&mut this.io), cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.close_sealed {
            ready!(self.as_mut().poll_flush(cx))?;
            let this = self.as_mut().get_mut();
            this.seal(true)?;
            this.close_sealed = true;
        }
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        tokio::io::AsyncWrite::poll_shutdown(Pin::new(&mut this.io), cx)
    }
}

impl AsyncRead for FastStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().rd).poll_read(cx, out)
    }
}

impl AsyncWrite for FastStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().wr).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().wr).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().wr).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair() -> (FastStream, FastStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let keys: Keys = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
        (
            FastStream::new(a.unwrap(), &keys, true, None).unwrap(),
            FastStream::new(b.unwrap().0, &keys, false, None).unwrap(),
        )
    }

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

    #[tokio::test]
    async fn records_round_trip_in_both_directions_and_close_cleanly() {
        let (a, b) = pair().await;
        let data: Vec<u8> = (0..3 * MAX_RECORD + 12345)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let (mut ar, mut aw) = a.into_split();
        let (mut br, mut bw) = b.into_split();
        let d = data.clone();
        let send = tokio::spawn(async move {
            // Odd-sized writes cross record boundaries.
            for c in d.chunks(70_001) {
                aw.write_all(c).await.unwrap();
            }
            aw.close().await.unwrap();
        });
        let mut got = Vec::new();
        br.read_to_end(&mut got).await.unwrap();
        send.await.unwrap();
        assert_eq!(got, data);
        bw.write_all(b"back").await.unwrap();
        bw.close().await.unwrap();
        let mut back = Vec::new();
        ar.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"back");
    }

    #[tokio::test]
    async fn truncation_tampering_and_oversized_records_are_errors() {
        // Dropped without close: the reader reports truncation, not a clean end.
        let (a, mut b) = pair().await;
        let (_ar, mut aw) = a.into_split();
        aw.write_all(b"partial").await.unwrap();
        aw.flush().await.unwrap();
        drop(aw);
        let mut got = Vec::new();
        let e = b.read_to_end(&mut got).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(got, b"partial");

        // A flipped ciphertext bit fails authentication.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let keys: Keys = [9u8; 64];
        let (raw, acc) = tokio::join!(TcpStream::connect(addr), l.accept());
        let mut raw = raw.unwrap();
        let mut b = FastStream::new(acc.unwrap().0, &keys, false, None).unwrap();
        let k = key(&keys[..32]).unwrap();
        let record = |counter: u64, data: &[u8]| {
            let mut buf = vec![0u8; HEAD];
            buf.extend_from_slice(data);
            seal_record(&k, counter, &mut buf, false).unwrap();
            buf
        };
        let mut rec = record(0, b"secret values");
        rec[HEAD + 2] ^= 1;
        tokio::io::AsyncWriteExt::write_all(&mut raw, &rec)
            .await
            .unwrap();
        let mut one = [0u8; 4];
        let e = b.read_exact(&mut one).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);

        // A length word over the limit is refused before anything is read into it.
        let (raw, acc) = tokio::join!(TcpStream::connect(addr), l.accept());
        let mut raw = raw.unwrap();
        let mut b = FastStream::new(acc.unwrap().0, &keys, false, None).unwrap();
        let huge = (MAX_RECORD as u32 + 1).to_le_bytes();
        tokio::io::AsyncWriteExt::write_all(&mut raw, &huge)
            .await
            .unwrap();
        let e = b.read_exact(&mut one).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);

        // A replayed record (same nonce twice) fails the second time.
        let (raw, acc) = tokio::join!(TcpStream::connect(addr), l.accept());
        let mut raw = raw.unwrap();
        let mut b = FastStream::new(acc.unwrap().0, &keys, false, None).unwrap();
        let rec = record(0, b"abcd");
        tokio::io::AsyncWriteExt::write_all(&mut raw, &rec)
            .await
            .unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut raw, &rec)
            .await
            .unwrap();
        b.read_exact(&mut one).await.unwrap();
        assert_eq!(&one, b"abcd");
        let e = b.read_exact(&mut one).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }
}
