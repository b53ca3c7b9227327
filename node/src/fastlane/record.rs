//! Fast lane records: how a [`FastStream`] seals what it writes and opens what it reads.
//!
//! A record is `[length word][ciphertext][tag]`: the little-endian `u32` length word (its top
//! bit marks the empty record that closes a direction) is the AEAD's additional data, the body
//! is AES-256-GCM ciphertext of at most [`MAX_RECORD`] bytes, and the 16-byte tag follows.
//! Each direction has its own key and a counter nonce that starts at 0, so a replayed,
//! reordered or dropped record fails authentication, and an end without the close record
//! reads as truncation.
//!
//! Record 0 of each direction is the lane's greeting ([`seal_greeting`], [`open_greeting`]):
//! exactly [`GREETING`] bytes, read into a buffer of that size, so a listener allocates a
//! stream's buffers only once the dialer has proven its keys. A [`FastStream`] starts at
//! record 1.

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use futures::{AsyncRead, AsyncWrite};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use std::time::Duration;
use tokio::io::ReadBuf;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::simdelay::DelayedReader;

use super::handshake::Keys;

/// Largest plaintext in one record. Small enough that a record stays in L2 while it is copied
/// and sealed, large enough that per-record costs vanish.
pub const MAX_RECORD: usize = 256 * 1024;
/// Bytes of a record's length word.
const HEAD: usize = 4;
/// Bytes of a record's AES-GCM tag.
const TAG: usize = 16;
/// Set in a record's length word for the (empty) record that ends a stream.
const CLOSE_BIT: u32 = 1 << 31;

/// Bytes of a greeting record: a length word, 16 bytes of ciphertext, the tag.
pub(super) const GREETING: usize = HEAD + 16 + TAG;

/// Held by both halves of a lane: a second handle on its socket, through which
/// [`FastLane::stop`](super::FastLane::stop) shuts the connection down (what a killed node's
/// connections do).
pub(super) struct LaneGuard(pub(super) std::net::TcpStream);

/// The AES-GCM nonce of a direction's `counter`-th record: 4 zero bytes, then the counter LE.
fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

/// An AES-256-GCM key from 32 bytes.
fn key(bytes: &[u8]) -> io::Result<LessSafeKey> {
    UnboundKey::new(&AES_256_GCM, bytes)
        .map(LessSafeKey::new)
        .map_err(|_| io::Error::other("bad key"))
}

/// An `InvalidData` error: the peer sent something no honest peer sends.
fn bad(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// A direction's greeting (its record 0) carrying `msg`, sealed with `key` (32 bytes).
pub(super) fn seal_greeting(key_bytes: &[u8], msg: &[u8; 16]) -> io::Result<[u8; GREETING]> {
    let mut buf = Vec::with_capacity(GREETING);
    buf.extend_from_slice(&[0u8; HEAD]);
    buf.extend_from_slice(msg);
    seal_record(&key(key_bytes)?, 0, &mut buf, false)?;
    buf.try_into()
        .map_err(|_| io::Error::other("greeting of the wrong size"))
}

/// Opens a direction's greeting: it must announce exactly 16 bytes and pass authentication
/// with `key` as record 0.
pub(super) fn open_greeting(key_bytes: &[u8], record: &[u8; GREETING]) -> io::Result<[u8; 16]> {
    let mut rec = *record;
    let (head, body) = rec.split_at_mut(HEAD);
    let head: [u8; HEAD] = head.try_into().map_err(|_| bad("short greeting"))?;
    if u32::from_le_bytes(head) != 16 {
        return Err(bad("fast lane greeting of the wrong size"));
    }
    let plain = key(key_bytes)?
        .open_in_place(nonce(0), Aad::from(head), body)
        .map_err(|_| bad("fast lane greeting failed authentication"))?;
    plain.try_into().map_err(|_| bad("short greeting"))
}

/// An authenticated, encrypted, full-duplex byte stream to one peer (see [`crate::fastlane`]).
/// Writes are buffered into records: call `flush` when the peer must see what was written, and
/// `close` to end the stream (a stream dropped without `close` reads as truncated on the other
/// side). [`FastStream::into_split`] gives halves that work in separate tasks, so sealing and
/// opening run on two cores:
///
/// ```no_run
/// # async fn demo(node: starling_node::Node, peer: starling_node::PeerId) -> std::io::Result<()> {
/// use futures::{AsyncReadExt, AsyncWriteExt};
/// use starling_node::StreamProtocol;
/// let lane = node.open_fast(peer, StreamProtocol::new("/example/echo/1")).await.map_err(std::io::Error::other)?;
/// let (mut rd, mut wr) = lane.into_split();
/// let sender = tokio::spawn(async move {
///     wr.write_all(&vec![7u8; 1 << 20]).await?;
///     wr.close().await // flushes the last record, then seals the close record
/// });
/// let mut echoed = Vec::new();
/// rd.read_to_end(&mut echoed).await?; // ends cleanly only at the peer's close record
/// sender.await.map_err(std::io::Error::other)??;
/// # Ok(()) }
/// ```
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
    /// A lane over a connected socket; `keys` as derived, `dialer` picks which key each
    /// direction uses; both directions continue at record `first` (1 after the greetings);
    /// `guard` lets the node cut the lane when it stops.
    pub(super) fn new(
        tcp: TcpStream,
        keys: &Keys,
        dialer: bool,
        first: u64,
        guard: Option<Arc<LaneGuard>>,
        read_delay: Option<Duration>,
    ) -> io::Result<Self> {
        let (out, inn) = if dialer {
            (&keys[..32], &keys[32..])
        } else {
            (&keys[32..], &keys[..32])
        };
        let (r, w) = tcp.into_split();
        let io = match read_delay {
            Some(d) => LaneRead::Delayed(DelayedReader::new(r, d)),
            None => LaneRead::Tcp(r),
        };
        Ok(FastStream {
            rd: FastReader {
                io,
                key: key(inn)?,
                counter: first,
                buf: vec![0u8; 2 * (HEAD + MAX_RECORD + TAG)],
                raw: 0..0,
                plain: 0..0,
                closed: false,
                born: std::time::Instant::now(),
                _guard: guard.clone(),
            },
            wr: FastWriter {
                io: w,
                key: key(out)?,
                counter: first,
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

    /// Puts the halves of one lane back together (to keep the lane for later use); halves of
    /// different lanes are handed back as they came.
    ///
    /// ```no_run
    /// # fn f(lane: starling_node::FastStream) {
    /// let (rd, wr) = lane.into_split();
    /// let lane = starling_node::FastStream::unsplit(rd, wr).ok().expect("halves of one lane");
    /// # let _ = lane; }
    /// ```
    #[allow(clippy::result_large_err)]
    pub fn unsplit(rd: FastReader, wr: FastWriter) -> Result<Self, (FastReader, FastWriter)> {
        let same = match (&rd._guard, &wr._guard) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            // Only test lanes have no guard.
            (None, None) => true,
            _ => false,
        };
        if same && !rd.closed && !wr.close_sealed {
            Ok(FastStream { rd, wr })
        } else {
            Err((rd, wr))
        }
    }

    /// Records sealed or opened so far in the busier direction: a lane that is kept for reuse
    /// is retired well before its counter nonces could matter.
    pub fn records(&self) -> u64 {
        self.rd.counter.max(self.wr.counter)
    }

    /// Time since the lane's keys were made.
    pub fn age(&self) -> std::time::Duration {
        self.rd.born.elapsed()
    }

    /// Whether an idle lane can still carry a new exchange: nothing is half-written, the peer
    /// has not closed or reset it, and no bytes arrived that nobody has read (bytes that are
    /// waiting in the socket are taken into the read buffer, never lost). Never blocks.
    pub fn is_reusable(&mut self) -> bool {
        if self.wr.sealed || self.wr.close_sealed || self.wr.buf.len() > HEAD || self.rd.closed {
            return false;
        }
        let rd = &mut self.rd;
        if !rd.raw.is_empty() || !rd.plain.is_empty() {
            return false;
        }
        rd.raw = 0..0;
        match rd.io.try_read(&mut rd.buf[..]) {
            // Nothing waiting: the connection is open and quiet.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => true,
            // End of stream or an error: the peer is gone.
            Ok(0) | Err(_) => false,
            // Unsolicited bytes on an idle lane: keep them, but the lane is not clean.
            Ok(n) => {
                rd.raw = 0..n;
                false
            }
        }
    }
}

/// A lane's read side: the socket's, or one whose reads are held back (a simulation, see
/// [`crate::simdelay`]).
enum LaneRead {
    Tcp(OwnedReadHalf),
    Delayed(DelayedReader),
}

impl LaneRead {
    fn try_read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        match self {
            LaneRead::Tcp(r) => r.try_read(out),
            LaneRead::Delayed(r) => r.try_read(out),
        }
    }
}

impl tokio::io::AsyncRead for LaneRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            LaneRead::Tcp(r) => Pin::new(r).poll_read(cx, buf),
            LaneRead::Delayed(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

/// The receiving half of a [`FastStream`].
pub struct FastReader {
    io: LaneRead,
    key: LessSafeKey,
    counter: u64,
    buf: Vec<u8>,
    /// Received bytes not yet opened.
    raw: Range<usize>,
    /// Opened plaintext not yet handed out.
    plain: Range<usize>,
    closed: bool,
    /// When the lane was made (both halves' lane).
    born: std::time::Instant,
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
    use futures::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    async fn pair() -> (FastStream, FastStream) {
        delayed_pair(None).await
    }

    async fn delayed_pair(delay: Option<Duration>) -> (FastStream, FastStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let keys: Keys = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
        (
            FastStream::new(a.unwrap(), &keys, true, 0, None, delay).unwrap(),
            FastStream::new(b.unwrap().0, &keys, false, 0, None, delay).unwrap(),
        )
    }

    #[tokio::test]
    async fn a_delayed_lane_carries_records_both_ways() {
        let (a, b) = delayed_pair(Some(Duration::from_millis(30))).await;
        let (mut ar, mut aw) = a.into_split();
        let (mut br, mut bw) = b.into_split();
        let start = std::time::Instant::now();
        aw.write_all(b"hello").await.unwrap();
        aw.flush().await.unwrap();
        let mut got = [0u8; 5];
        br.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
        bw.write_all(b"there").await.unwrap();
        bw.flush().await.unwrap();
        ar.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"there");
        assert!(start.elapsed() >= Duration::from_millis(60));
    }

    #[tokio::test]
    async fn an_idle_lane_is_reusable_until_the_peer_closes_or_speaks_out_of_turn() {
        let (a, b) = pair().await;
        let (mut ar, mut aw) = a.into_split();
        let (mut br, mut bw) = b.into_split();
        aw.write_all(b"hello").await.unwrap();
        aw.flush().await.unwrap();
        let mut got = [0u8; 5];
        br.read_exact(&mut got).await.unwrap();
        bw.write_all(b"ready").await.unwrap();
        bw.flush().await.unwrap();
        ar.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ready");
        let mut a = FastStream::unsplit(ar, aw).ok().unwrap();
        let mut b = FastStream::unsplit(br, bw).ok().unwrap();
        assert!(a.is_reusable() && b.is_reusable());
        assert_eq!(a.records(), 1);
        // A half-written record is not reusable until flushed.
        a.write_all(b"x").await.unwrap();
        assert!(!a.is_reusable());
        a.flush().await.unwrap();
        assert!(a.is_reusable());
        // Bytes nobody asked for: not clean, but they are kept for the reader.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!b.is_reusable());
        b.read_exact(&mut got[..1]).await.unwrap();
        assert_eq!(got[0], b'x');
        assert!(b.is_reusable());
        // The peer goes away: its end closes, and the idle lane says so.
        a.close().await.unwrap();
        drop(a);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!b.is_reusable());
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
        let mut b = FastStream::new(acc.unwrap().0, &keys, false, 0, None, None).unwrap();
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
        let mut b = FastStream::new(acc.unwrap().0, &keys, false, 0, None, None).unwrap();
        let huge = (MAX_RECORD as u32 + 1).to_le_bytes();
        tokio::io::AsyncWriteExt::write_all(&mut raw, &huge)
            .await
            .unwrap();
        let e = b.read_exact(&mut one).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);

        // A replayed record (same nonce twice) fails the second time.
        let (raw, acc) = tokio::join!(TcpStream::connect(addr), l.accept());
        let mut raw = raw.unwrap();
        let mut b = FastStream::new(acc.unwrap().0, &keys, false, 0, None, None).unwrap();
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

    #[test]
    fn greetings_are_exactly_sized_records_zero() {
        let keys: Keys = std::array::from_fn(|i| i as u8);
        let g = seal_greeting(&keys[..32], b"0123456789abcdef").unwrap();
        assert_eq!(
            open_greeting(&keys[..32], &g).unwrap(),
            *b"0123456789abcdef"
        );
        // The other direction's key does not open it.
        assert!(open_greeting(&keys[32..], &g).is_err());
        // A length word announcing anything but 16 bytes is refused, before any decryption.
        for word in [0u32, 15, 17, MAX_RECORD as u32, 16 | CLOSE_BIT] {
            let mut bad = g;
            bad[..HEAD].copy_from_slice(&word.to_le_bytes());
            let e = open_greeting(&keys[..32], &bad).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        }
        let mut flipped = g;
        flipped[GREETING - 1] ^= 1;
        assert!(open_greeting(&keys[..32], &flipped).is_err());
    }
}
