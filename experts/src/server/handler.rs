//! Serving client streams: admission (at most `max_streams` open at once, from accept to
//! close), the hello read by [`starling_node::streams::serve_inbound`], then one request after
//! another on each stream until it idles, breaks the framing or the server stops.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};

use futures::{AsyncRead, AsyncWrite, AsyncWriteExt, StreamExt};
use starling_node::streams::{serve_inbound, InboundLimits};
use starling_node::PeerId;

use super::metrics::ExpertMetrics;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::timeout;
use tracing::debug;

use super::request::handle;
use super::Shared;
use crate::error::{RemoteError, RemoteErrorKind};
use crate::wire::{read_msg, write_msg, FrameError, Request, Response};

/// Largest hello, in bytes.
const MAX_HELLO_BYTES: usize = 1024;

/// Serves expert streams until `stop`, then waits for the stream handlers to end.
///
/// Handlers run on tasks of `serve_inbound`'s, which nobody joins; instead each one holds an
/// `Arc` of `serving` while it serves (it gets it by upgrading a `Weak`, so a stream whose
/// hello arrives after the stop finds nothing to upgrade and is dropped), and the loop waits
/// for the last of them to let go. Every handler ends at once on the stop signal.
pub(super) async fn accept_loop<S>(
    shared: Arc<Shared>,
    incoming: impl futures::Stream<Item = (PeerId, S)> + Unpin + Send,
    mut stop: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let cfg = &shared.cfg;
    let open = Arc::new(Semaphore::new(cfg.max_streams));
    let admitted = incoming.filter_map(move |(peer, stream)| {
        futures::future::ready(Admitted::new(&open, peer, stream).map(|s| (peer, s)))
    });
    let limits = InboundLimits {
        max_pending: cfg.max_streams,
        first_message_timeout: cfg.handshake_timeout,
        max_first_message: MAX_HELLO_BYTES,
    };
    let (all_done_tx, mut all_done) = mpsc::channel::<()>(1);
    let serving = Arc::new(all_done_tx);
    let handler = {
        let (shared, stop, serving) = (shared.clone(), stop.clone(), Arc::downgrade(&serving));
        move |peer, hello, stream| {
            serve_stream(
                shared.clone(),
                peer,
                hello,
                stream,
                stop.clone(),
                serving.clone(),
            )
        }
    };
    tokio::select! {
        _ = serve_inbound(admitted, limits, handler) => {}
        _ = stop.changed() => {}
    }
    drop(serving);
    // `None` once every handler has dropped its `Arc` (nothing is ever sent).
    let _ = all_done.recv().await;
}

/// One client stream after its first message: answers the hello, then serves requests until
/// the stream ends or the server stops (then the stream is dropped, as an abort would).
async fn serve_stream<S: AsyncRead + AsyncWrite + Unpin>(
    shared: Arc<Shared>,
    peer: PeerId,
    hello: Request,
    stream: Admitted<S>,
    mut stop: watch::Receiver<bool>,
    serving: Weak<mpsc::Sender<()>>,
) {
    let Some(_serving) = serving.upgrade() else {
        return; // the server is stopping
    };
    if !matches!(hello, Request::Hello) || *stop.borrow() {
        return;
    }
    tokio::select! {
        _ = serve_requests(&shared, peer, stream) => {}
        _ = stop.changed() => {}
    }
}

/// Confirms the stream with `Ready`, then answers requests one at a time. An idle stream and
/// one that sent a frame over `max_frame_bytes` (answered with `TooLarge`: the body was not
/// read, so the stream cannot be resynchronised) are closed; a broken one is dropped.
async fn serve_requests<S: AsyncRead + AsyncWrite + Unpin>(
    shared: &Shared,
    peer: PeerId,
    mut stream: Admitted<S>,
) {
    let cfg = &shared.cfg;
    if write_msg(&mut stream, &Response::Ready).await.is_err() {
        return;
    }
    loop {
        let next = read_msg::<_, Request>(&mut stream, cfg.max_frame_bytes);
        let read = timeout(cfg.idle_timeout, next).await;
        let started = std::time::Instant::now();
        let mut kind = "malformed";
        let response = match read {
            Err(_) => break, // idle
            Ok(Err(FrameError::Io(_))) => return,
            Ok(Err(FrameError::TooLarge { len, .. })) => {
                shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                let msg = format!(
                    "request of {len} bytes exceeds the limit of {} bytes",
                    cfg.max_frame_bytes
                );
                debug!(client = %peer, "{msg}");
                shared.metrics.observe("too_large", false, 0.0);
                let refusal = RemoteError::new(RemoteErrorKind::TooLarge, msg);
                let _ = write_msg(&mut stream, &Response::from(refusal)).await;
                break;
            }
            Ok(Err(FrameError::Malformed(m))) => {
                Err(RemoteError::new(RemoteErrorKind::Malformed, m))
            }
            Ok(Ok(req)) => {
                kind = ExpertMetrics::kind_of(&req);
                handle(shared, req).await
            }
        };
        shared
            .metrics
            .observe(kind, response.is_ok(), started.elapsed().as_secs_f64());
        let response = match response {
            Ok(r) => {
                shared.stats.served.fetch_add(1, Ordering::Relaxed);
                r
            }
            Err(e) => {
                shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                debug!(client = %peer, kind = ?e.kind, "refused: {}", e.message);
                Response::from(e)
            }
        };
        if write_msg(&mut stream, &response).await.is_err() {
            return;
        }
    }
    let _ = stream.close().await;
}

/// A stream that holds one of the server's `max_streams` places until it is dropped.
struct Admitted<S> {
    stream: S,
    _place: OwnedSemaphorePermit,
}

impl<S> Admitted<S> {
    /// The stream with a place, or `None` (the stream is dropped, which its opener sees as a
    /// dropped stream and retries) when every place is taken.
    fn new(open: &Arc<Semaphore>, peer: PeerId, stream: S) -> Option<Admitted<S>> {
        match open.clone().try_acquire_owned() {
            Ok(place) => Some(Admitted {
                stream,
                _place: place,
            }),
            Err(_) => {
                debug!(client = %peer, "too many expert streams; dropping a new one");
                None
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Admitted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Admitted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;
    use std::time::Duration;

    use crate::server::{ServerConfig, ServerStats};
    use starling_node::lock::lock;

    /// A client stream: replays `input`, then stays silent (pending) forever; keeps what the
    /// server writes; flags its drop.
    struct Fake {
        input: futures::io::Cursor<Vec<u8>>,
        output: Arc<Mutex<Vec<u8>>>,
        dropped: Arc<AtomicBool>,
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
        }
    }

    impl AsyncRead for Fake {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut [u8],
        ) -> Poll<std::io::Result<usize>> {
            match Pin::new(&mut self.input).poll_read(cx, buf) {
                Poll::Ready(Ok(0)) => Poll::Pending,
                other => other,
            }
        }
    }

    impl AsyncWrite for Fake {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            lock(&self.output).extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn client(requests: &[Request]) -> (Fake, Arc<Mutex<Vec<u8>>>, Arc<AtomicBool>) {
        let mut input = Vec::new();
        for r in requests {
            futures::executor::block_on(write_msg(&mut input, r)).unwrap();
        }
        let (output, dropped) = (Arc::default(), Arc::default());
        let fake = Fake {
            input: futures::io::Cursor::new(input),
            output: Arc::clone(&output),
            dropped: Arc::clone(&dropped),
        };
        (fake, output, dropped)
    }

    fn responses(output: &Mutex<Vec<u8>>) -> Vec<Response> {
        let bytes = lock(output).clone();
        let mut r = futures::io::Cursor::new(bytes);
        let mut out = Vec::new();
        while let Ok(m) = futures::executor::block_on(read_msg::<_, Response>(&mut r, 1 << 20)) {
            out.push(m);
        }
        out
    }

    #[tokio::test]
    async fn streams_are_admitted_served_and_dropped_on_stop() {
        let (runtime, _jobs) = mpsc::channel(1);
        let shared = Arc::new(Shared {
            cfg: ServerConfig {
                max_streams: 1,
                ..ServerConfig::default()
            },
            hosted: HashMap::new(),
            runtime,
            stats: Arc::new(ServerStats::default()),
            metrics: ExpertMetrics::of(&starling_node::metrics::Metrics::new()),
        });
        let (incoming_tx, incoming) = futures::channel::mpsc::unbounded();
        let (stop_tx, stop) = watch::channel(false);
        let server = tokio::spawn(accept_loop(shared.clone(), incoming, stop));
        let unknown = Request::Forward {
            uid: "ffn.9".into(),
            inputs: vec![],
        };
        let (first, first_out, first_dropped) = client(&[Request::Hello, unknown]);
        incoming_tx
            .unbounded_send((PeerId::random(), first))
            .unwrap();
        let served = async {
            while responses(&first_out).len() < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        timeout(Duration::from_secs(5), served).await.unwrap();
        let answers = responses(&first_out);
        assert!(matches!(answers[0], Response::Ready));
        assert!(matches!(
            answers[1],
            Response::Error {
                kind: RemoteErrorKind::UnknownExpert,
                ..
            }
        ));
        assert_eq!(shared.stats.refused.load(Ordering::Relaxed), 1);
        // The only place is taken: a second stream is dropped unanswered.
        let (second, second_out, second_dropped) = client(&[Request::Hello]);
        incoming_tx
            .unbounded_send((PeerId::random(), second))
            .unwrap();
        let dropped = async {
            while !second_dropped.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        timeout(Duration::from_secs(5), dropped).await.unwrap();
        assert!(lock(&second_out).is_empty());
        // Stop: the idle first stream is dropped and the loop returns, without waiting for
        // the idle timeout.
        stop_tx.send(true).unwrap();
        timeout(Duration::from_secs(5), server)
            .await
            .expect("the accept loop ends on stop")
            .unwrap();
        assert!(first_dropped.load(Ordering::SeqCst));
    }
}
