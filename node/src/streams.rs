//! Opening streams that the other side really took, and serving the first message of inbound
//! ones: the one place that works around `libp2p-stream`'s accept queue.
//!
//! `libp2p-stream` hands inbound streams to the accepting side over a zero-capacity channel
//! with `try_send`: under bursts (several peers opening at once) it **drops** streams, and the
//! opener only learns of it when its first read fails. So every Starling protocol opens with a
//! hello message and waits for the answer: [`open_confirmed`] sends the hello, reads one reply
//! and retries (a fresh stream, a short growing pause) when the stream was dropped, until its
//! deadline. The accepting side is [`serve_inbound`]: it reads each stream's first message
//! within a timeout and a size bound, with a bounded number of streams in that state at once,
//! and hands message and stream to the protocol's handler on a task of its own.
//!
//! Both are generic over the stream type, so they serve libp2p streams and fast lanes alike.
//!
//! ```no_run
//! # async fn demo(node: starling_node::Node, peer: starling_node::PeerId) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use starling_node::{streams::{open_confirmed, Retry}, StreamProtocol};
//! const PROTO: StreamProtocol = StreamProtocol::new("/example/1");
//! let control = node.stream_control();
//! let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
//! let opened = open_confirmed(
//!     || { let mut c = control.clone(); async move { c.open_stream(peer, PROTO).await } },
//!     &"hello".to_string(),
//!     1024,
//!     deadline,
//!     Retry::default(),
//! ).await?;
//! let reply: String = opened.reply;
//! # let _ = reply; Ok(()) }
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{AsyncRead, AsyncWrite, Stream as FutStream, StreamExt};
use serde::{de::DeserializeOwned, Serialize};
use tokio::sync::Semaphore;
use tokio::time::{timeout, timeout_at, Instant};
use tracing::Instrument;

use crate::framing::{read_msg, write_msg, FrameError};
use crate::PeerId;

/// How [`open_confirmed`] retries a stream that the other side dropped.
#[derive(Debug, Clone, Copy)]
pub struct Retry {
    /// Attempts at most (the deadline may end them sooner).
    pub attempts: u32,
    /// Pause after the first failed attempt; it grows linearly, capped at 8 times this.
    pub pause: Duration,
    /// Attempts in a row that could not open a stream at all (no connection to the peer could
    /// be made or kept) after which it gives up: a peer that is gone fails every dial at once,
    /// and retrying until the deadline only makes the caller wait for it. Stream drops (the
    /// peer is there but its accept queue was full) do not count.
    pub open_failures: u32,
}

impl Default for Retry {
    /// Retries until the deadline, pausing 25 ms, 50 ms, ... 200 ms between attempts, however
    /// the attempts fail.
    fn default() -> Self {
        Retry {
            attempts: u32::MAX,
            pause: Duration::from_millis(25),
            open_failures: u32::MAX,
        }
    }
}

/// A stream whose hello the other side answered.
#[derive(Debug)]
pub struct Confirmed<S, R> {
    /// The stream, ready for the protocol's next message.
    pub stream: S,
    /// The other side's answer to the hello.
    pub reply: R,
    /// Bytes of the hello that went out on this stream.
    pub sent: usize,
    /// Attempts it took (1 when the first stream was taken).
    pub attempts: u32,
}

/// Why [`open_confirmed`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// No attempt got an answer before the deadline or the attempt limit.
    #[error("no answer after {attempts} attempts: {last}")]
    Unanswered {
        /// Attempts made.
        attempts: u32,
        /// The last failure seen (what the stream or the opener said).
        last: String,
        /// True when the deadline ended the attempts.
        timed_out: bool,
    },
    /// The other side answered with something that is not a valid reply: a broken or hostile
    /// peer, not a dropped stream, so no retry.
    #[error("invalid answer to the hello: {0}")]
    BadReply(FrameError),
}

/// Opens a stream with `open`, sends `hello` and reads the reply (at most `max_reply` bytes),
/// retrying with a fresh stream when the stream fails before a reply arrives (the other side's
/// accept queue dropped it), until `deadline` or `retry.attempts`. Every wait ends by
/// `deadline`. Retrying is only safe for protocols where a repeated hello is harmless (each
/// one arrives on a new stream; a handler that counts peers must count each peer once).
pub async fn open_confirmed<S, E, F, Fut, H, R>(
    mut open: F,
    hello: &H,
    max_reply: usize,
    deadline: Instant,
    retry: Retry,
) -> Result<Confirmed<S, R>, OpenError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<S, E>>,
    H: Serialize,
    R: DeserializeOwned,
{
    let mut last = String::from("no attempt");
    let mut attempts = 0u32;
    let mut open_failures = 0u32;
    let unanswered = |attempts, last, timed_out| OpenError::Unanswered {
        attempts,
        last,
        timed_out,
    };
    while attempts < retry.attempts.max(1) {
        if attempts > 0 {
            let pause = retry.pause * attempts.min(8);
            if Instant::now() + pause >= deadline {
                return Err(unanswered(attempts, last, true));
            }
            tokio::time::sleep(pause).await;
        }
        attempts += 1;
        let mut stream = match timeout_at(deadline, open()).await {
            Ok(Ok(s)) => {
                open_failures = 0;
                s
            }
            Ok(Err(e)) => {
                last = format!("cannot open a stream: {e}");
                open_failures += 1;
                if open_failures >= retry.open_failures.max(1) {
                    return Err(unanswered(attempts, last, false));
                }
                continue;
            }
            Err(_) => return Err(unanswered(attempts, last, true)),
        };
        let exchange = async {
            let sent = write_msg(&mut stream, hello).await?;
            let reply = read_msg::<_, R>(&mut stream, max_reply).await?;
            Ok::<_, FrameError>((sent, reply))
        };
        match timeout_at(deadline, exchange).await {
            Ok(Ok((sent, reply))) => {
                return Ok(Confirmed {
                    stream,
                    reply,
                    sent,
                    attempts,
                })
            }
            Ok(Err(FrameError::Io(e))) => {
                tracing::debug!(
                    attempts,
                    "stream dropped before its hello was answered: {e}"
                );
                last = format!("stream dropped before answering: {e}");
            }
            Ok(Err(bad)) => return Err(OpenError::BadReply(bad)),
            Err(_) => {
                last = "the other side did not answer in time".into();
                return Err(unanswered(attempts, last, true));
            }
        }
    }
    Err(unanswered(attempts, last, false))
}

/// Limits for [`serve_inbound`].
#[derive(Debug, Clone, Copy)]
pub struct InboundLimits {
    /// Streams whose first message is being read at once; more are dropped (refused).
    pub max_pending: usize,
    /// How long a stream may take to deliver its first message.
    pub first_message_timeout: Duration,
    /// Largest first message, in bytes.
    pub max_first_message: usize,
}

/// Serves one inbound protocol until `incoming` ends: reads each stream's first message
/// (bounded in time and size, at most `limits.max_pending` streams at once; extra streams are
/// dropped, which the opener sees as a refusal) and runs `handle(peer, message, stream)` on a
/// task of its own, inside the current tracing span. Streams whose first message does not
/// arrive or does not decode are dropped with a debug log.
pub async fn serve_inbound<S, M, F, Fut>(
    mut incoming: impl FutStream<Item = (PeerId, S)> + Unpin,
    limits: InboundLimits,
    handle: F,
) where
    S: AsyncRead + Unpin + Send + 'static,
    M: DeserializeOwned + Send + 'static,
    F: Fn(PeerId, M, S) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let pending = Arc::new(Semaphore::new(limits.max_pending));
    while let Some((peer, mut stream)) = incoming.next().await {
        let Ok(permit) = pending.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "too many inbound streams waiting for a first message; dropped");
            continue;
        };
        let handle = handle.clone();
        let task = async move {
            let first = timeout(
                limits.first_message_timeout,
                read_msg::<_, M>(&mut stream, limits.max_first_message),
            )
            .await;
            drop(permit);
            match first {
                Ok(Ok(msg)) => handle(peer, msg, stream).await,
                Ok(Err(e)) => tracing::debug!(%peer, "inbound stream refused: {e}"),
                Err(_) => tracing::debug!(%peer, "inbound stream sent no first message in time"),
            }
        };
        tokio::spawn(task.in_current_span());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::io::Cursor;

    /// A stream whose writes go nowhere and whose reads replay `input`.
    #[derive(Debug)]
    struct Fake {
        input: Cursor<Vec<u8>>,
    }
    impl AsyncRead for Fake {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut [u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::pin::Pin::new(&mut self.input).poll_read(cx, buf)
        }
    }
    impl AsyncWrite for Fake {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::task::Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_close(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    fn answering(reply: &str) -> Fake {
        let mut wire = Vec::new();
        futures::executor::block_on(write_msg(&mut wire, &reply.to_string())).unwrap();
        Fake {
            input: Cursor::new(wire),
        }
    }

    #[tokio::test]
    async fn dropped_streams_are_retried_until_one_answers() {
        let mut n = 0;
        let deadline = Instant::now() + Duration::from_secs(5);
        let got: Confirmed<Fake, String> = open_confirmed(
            || {
                n += 1;
                // Two streams dropped (they end at once), then one that answers.
                let s = if n < 3 {
                    Fake {
                        input: Cursor::new(Vec::new()),
                    }
                } else {
                    answering("ready")
                };
                async move { Ok::<_, String>(s) }
            },
            &1u8,
            64,
            deadline,
            Retry {
                attempts: 5,
                pause: Duration::from_millis(1),
                ..Retry::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(got.reply, "ready".to_string());
        assert_eq!(got.attempts, 3);
        assert!(got.sent > 0);
    }

    #[tokio::test]
    async fn a_peer_that_cannot_be_reached_is_given_up_on_after_open_failures_in_a_row() {
        let deadline = Instant::now() + Duration::from_secs(30);
        let retry = Retry {
            pause: Duration::from_millis(1),
            open_failures: 3,
            ..Retry::default()
        };
        // Dropped streams do not count: 2 opens fail, a stream is dropped, 2 more fail, then a
        // stream answers (4 failures in all, never 3 in a row).
        let mut n = 0;
        let got: Confirmed<Fake, String> = open_confirmed(
            || {
                n += 1;
                let s = match n {
                    3 => Ok(Fake {
                        input: Cursor::new(Vec::new()),
                    }),
                    6 => Ok(answering("ready")),
                    _ => Err("dial failed"),
                };
                async move { s }
            },
            &1u8,
            64,
            deadline,
            retry,
        )
        .await
        .unwrap();
        assert_eq!(got.attempts, 6);
        // Every open failing: given up after the third, long before the deadline.
        let mut n = 0;
        let err = open_confirmed::<Fake, _, _, _, _, String>(
            || {
                n += 1;
                async { Err("dial failed") }
            },
            &1u8,
            64,
            deadline,
            retry,
        )
        .await
        .unwrap_err();
        assert!(
            matches!(
                &err,
                OpenError::Unanswered {
                    attempts: 3,
                    timed_out: false,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(n, 3);
    }

    #[tokio::test]
    async fn attempts_run_out_and_bad_replies_are_not_retried() {
        let deadline = Instant::now() + Duration::from_secs(5);
        let retry = Retry {
            attempts: 3,
            pause: Duration::from_millis(1),
            ..Retry::default()
        };
        let err = open_confirmed::<Fake, _, _, _, _, String>(
            || async { Err("refused") },
            &1u8,
            64,
            deadline,
            retry,
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&err, OpenError::Unanswered { attempts: 3, timed_out: false, last } if last.contains("refused")),
            "{err}"
        );
        // A reply over the limit: the peer is broken, one attempt only.
        let mut calls = 0;
        let err = open_confirmed::<_, String, _, _, _, String>(
            || {
                calls += 1;
                async { Ok(answering("a long answer that is over the limit")) }
            },
            &1u8,
            4,
            deadline,
            retry,
        )
        .await
        .unwrap_err();
        assert!(matches!(
            err,
            OpenError::BadReply(FrameError::TooLarge { .. })
        ));
        assert_eq!(calls, 1);
    }

    #[tokio::test]
    async fn inbound_streams_get_their_first_message_or_are_dropped() {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        let limits = InboundLimits {
            max_pending: 4,
            first_message_timeout: Duration::from_secs(1),
            max_first_message: 64,
        };
        let server = tokio::spawn(serve_inbound(
            rx,
            limits,
            move |peer, msg: String, _s: Fake| {
                let seen_tx = seen_tx.clone();
                async move {
                    let _ = seen_tx.send((peer, msg));
                }
            },
        ));
        let peer = PeerId::random();
        tx.unbounded_send((peer, answering("first"))).unwrap();
        // Garbage and an empty stream never reach the handler.
        tx.unbounded_send((
            peer,
            Fake {
                input: Cursor::new(vec![2, 0, 0, 0, 0xff, 0xff]),
            },
        ))
        .unwrap();
        tx.unbounded_send((
            peer,
            Fake {
                input: Cursor::new(Vec::new()),
            },
        ))
        .unwrap();
        tx.unbounded_send((peer, answering("second"))).unwrap();
        drop(tx);
        server.await.unwrap();
        let mut got = Vec::new();
        while got.len() < 2 {
            let (p, m) = timeout(Duration::from_secs(5), seen.recv())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(p, peer);
            got.push(m);
        }
        got.sort();
        assert_eq!(got, vec!["first".to_string(), "second".to_string()]);
        // Every handler ran and dropped its sender: nothing else arrives.
        let rest = timeout(Duration::from_secs(5), seen.recv()).await.unwrap();
        assert!(rest.is_none());
    }
}
