//! Simulated network delay, for benches on one machine (this kernel kind has no `netem`).
//!
//! **A simulation, not a feature of real links.** With
//! [`NodeConfig::simulated_rtt`](crate::NodeConfig::simulated_rtt) set, every byte that arrives
//! on one of the node's TCP connections (libp2p's and the fast lane's) is handed to the reader
//! half that time after the kernel delivered it, so a round trip between two such nodes gains the
//! whole `simulated_rtt`. Bandwidth is not limited here (use `tc tbf` for that) and nothing is
//! lost or reordered. QUIC is not used while it is set (UDP would pass around the delay).
//!
//! Each delayed reader runs one task that reads the socket as data arrives and queues it,
//! stamped, in a bounded queue ([`QUEUED_READS`] reads of at most [`READ_BYTES`]); when the
//! queue is full the task stops reading and TCP's own flow control slows the sender, as a full
//! receive window would.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, Sleep};

/// Most bytes one read of the socket takes.
pub const READ_BYTES: usize = 64 * 1024;
/// Most reads queued before the reading task waits (16 MiB at most in flight per reader).
pub const QUEUED_READS: usize = 256;

/// What the reading task queues: bytes to hand out at a time, or the end of the stream.
enum Arrival {
    Data(Instant, Vec<u8>),
    End(Option<io::Error>),
}

/// The read side of a socket with every byte held back `delay` after it arrived.
pub struct DelayedReader {
    rx: mpsc::Receiver<Arrival>,
    /// Bytes due at a time, and how many of them were handed out.
    current: Option<(Instant, Vec<u8>, usize)>,
    ended: Option<Option<io::Error>>,
    sleep: Pin<Box<Sleep>>,
    task: JoinHandle<()>,
}

impl Drop for DelayedReader {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl DelayedReader {
    /// Delays what `inner` reads by `delay`. Must be called within a Tokio runtime.
    pub fn new(mut inner: OwnedReadHalf, delay: Duration) -> Self {
        let (tx, rx) = mpsc::channel(QUEUED_READS);
        let task = tokio::spawn(async move {
            loop {
                let mut buf = vec![0u8; READ_BYTES];
                let end = match inner.read(&mut buf).await {
                    Ok(0) => Arrival::End(None),
                    Ok(n) => {
                        buf.truncate(n);
                        if tx
                            .send(Arrival::Data(Instant::now() + delay, buf))
                            .await
                            .is_err()
                        {
                            return;
                        }
                        continue;
                    }
                    Err(e) => Arrival::End(Some(e)),
                };
                let _ = tx.send(end).await;
                return;
            }
        });
        DelayedReader {
            rx,
            current: None,
            ended: None,
            sleep: Box::pin(tokio::time::sleep(Duration::ZERO)),
            task,
        }
    }

    /// The next bytes that are due, or `Pending` until they are.
    fn poll_due(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<&[u8]>>> {
        loop {
            if let Some((at, bytes, taken)) = &self.current {
                if *taken < bytes.len() {
                    if Instant::now() < *at {
                        self.sleep.as_mut().reset(*at);
                        ready!(self.sleep.as_mut().poll(cx));
                    }
                    let (_, bytes, taken) = self.current.as_ref().expect("checked above");
                    return Poll::Ready(Ok(Some(&bytes[*taken..])));
                }
                self.current = None;
            }
            if let Some(end) = &mut self.ended {
                return Poll::Ready(match end.take() {
                    Some(e) => Err(e),
                    None => Ok(None),
                });
            }
            match ready!(self.rx.poll_recv(cx)) {
                Some(Arrival::Data(at, bytes)) => self.current = Some((at, bytes, 0)),
                Some(Arrival::End(e)) => self.ended = Some(e),
                None => self.ended = Some(None),
            }
        }
    }

    fn consume(&mut self, n: usize) {
        if let Some((_, _, taken)) = &mut self.current {
            *taken += n;
        }
    }

    /// Like `TcpStream::try_read`: what is due now, `WouldBlock` when nothing is, `Ok(0)` at
    /// the end of the stream.
    pub fn try_read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        match self.poll_due(&mut cx) {
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
            Poll::Ready(Err(e)) => Err(e),
            Poll::Ready(Ok(None)) => Ok(0),
            Poll::Ready(Ok(Some(due))) => {
                let n = due.len().min(out.len());
                out[..n].copy_from_slice(&due[..n]);
                self.consume(n);
                Ok(n)
            }
        }
    }
}

impl AsyncRead for DelayedReader {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match ready!(this.poll_due(cx))? {
            None => Poll::Ready(Ok(())),
            Some(due) => {
                let n = due.len().min(buf.remaining());
                buf.put_slice(&due[..n]);
                this.consume(n);
                Poll::Ready(Ok(()))
            }
        }
    }
}

/// A TCP connection whose reads are delayed (see the module docs); writes go straight out.
/// Speaks `futures`' I/O traits, for libp2p's transport.
pub struct DelayedStream {
    rd: DelayedReader,
    wr: OwnedWriteHalf,
}

impl DelayedStream {
    /// Delays what `tcp` reads by `delay`. Must be called within a Tokio runtime.
    pub fn new(tcp: TcpStream, delay: Duration) -> Self {
        let (rd, wr) = tcp.into_split();
        DelayedStream {
            rd: DelayedReader::new(rd, delay),
            wr,
        }
    }
}

impl futures::AsyncRead for DelayedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let mut buf = ReadBuf::new(out);
        ready!(Pin::new(&mut self.get_mut().rd).poll_read(cx, &mut buf))?;
        Poll::Ready(Ok(buf.filled().len()))
    }
}

impl futures::AsyncWrite for DelayedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().wr).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().wr).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().wr).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpListener;

    async fn pair(delay: Duration) -> (DelayedStream, DelayedStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(l.local_addr().unwrap()), l.accept());
        (
            DelayedStream::new(a.unwrap(), delay),
            DelayedStream::new(b.unwrap().0, delay),
        )
    }

    #[tokio::test]
    async fn a_round_trip_takes_both_delays_and_every_byte_arrives_in_order() {
        let (mut a, mut b) = pair(Duration::from_millis(40)).await;
        // 4 MB each way, random bytes: nothing lost or reordered.
        let data: Vec<u8> = (0..4_000_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let sent = data.clone();
        let echo = tokio::spawn(async move {
            let mut got = vec![0u8; sent.len()];
            b.read_exact(&mut got).await.unwrap();
            b.write_all(&got).await.unwrap();
            b.flush().await.unwrap();
            let mut one = [0u8; 1];
            b.read_exact(&mut one).await.unwrap();
            b.write_all(&one).await.unwrap();
            b
        });
        a.write_all(&data).await.unwrap();
        let mut back = vec![0u8; data.len()];
        a.read_exact(&mut back).await.unwrap();
        assert!(back == data, "the echo differs");
        // One byte's round trip: at least both 40 ms delays.
        let start = std::time::Instant::now();
        a.write_all(&[7]).await.unwrap();
        let mut one = [0u8; 1];
        a.read_exact(&mut one).await.unwrap();
        let rtt = start.elapsed();
        assert_eq!(one, [7]);
        assert!(rtt >= Duration::from_millis(80), "round trip {rtt:?}");
        let mut b = echo.await.unwrap();
        // The end of the stream arrives after the data, delayed too.
        a.close().await.unwrap();
        let mut rest = Vec::new();
        b.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }

    #[tokio::test]
    async fn try_read_gives_only_what_is_due() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(l.local_addr().unwrap()), l.accept());
        let (rd, _wr) = a.unwrap().into_split();
        let mut rd = DelayedReader::new(rd, Duration::from_millis(50));
        let mut b = b.unwrap().0;
        tokio::io::AsyncWriteExt::write_all(&mut b, b"hello")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let mut out = [0u8; 16];
        let e = rd.try_read(&mut out).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(rd.try_read(&mut out).unwrap(), 5);
        assert_eq!(&out[..5], b"hello");
        drop(b);
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert_eq!(rd.try_read(&mut out).unwrap(), 0);
    }
}
