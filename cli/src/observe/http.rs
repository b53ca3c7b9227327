//! Serving an axum router on a loopback (by default) TCP listener, one hyper connection at a
//! time per task, with the bounds axum::serve does not give:
//! - at most [`MAX_CONNECTIONS`] connections (more are closed at once);
//! - a request head (line and headers) of at most [`MAX_HEAD_BYTES`] (hyper answers 431) read
//!   within [`HEADER_TIMEOUT`] (then the connection is closed);
//! - no request body at all beyond [`MAX_BODY_BYTES`] (413): every endpoint is read-only;
//! - every connection closed after [`CONNECTION_LIFETIME`];
//! - all of it stopped on the stop signal.
//!
//! Malformed requests get hyper's 400, unknown paths 404, other methods 405.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::body::Body;
use axum::extract::DefaultBodyLimit;
use axum::http::{header, Request, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Largest request line plus headers (bytes); hyper's minimum is 8 KiB.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Largest request body accepted (bytes): the endpoints take none.
pub const MAX_BODY_BYTES: usize = 1024;
/// Time a client has to send a request's head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest a connection stays open (keep-alive included).
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// Refuses requests that announce a body larger than [`MAX_BODY_BYTES`] (413) before any
/// handler runs; read-only endpoints have no use for one.
async fn refuse_bodies(req: Request<Body>, next: Next) -> Response {
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().parse::<u64>());
    match announced {
        Some(Ok(n)) if n > MAX_BODY_BYTES as u64 => {
            (StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n").into_response()
        }
        Some(Err(_)) => (StatusCode::BAD_REQUEST, "bad content-length\n").into_response(),
        _ if req.headers().contains_key(header::TRANSFER_ENCODING) => (
            StatusCode::PAYLOAD_TOO_LARGE,
            "request bodies are not accepted\n",
        )
            .into_response(),
        _ => next.run(req).await,
    }
}

/// Binds `addr` and serves `app` until `stop` turns true. Returns the bound address (the port
/// filled in) and the serving task.
pub async fn bind_and_serve(
    addr: SocketAddr,
    app: Router,
    stop: watch::Receiver<bool>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    let app = app
        .layer(axum::middleware::from_fn(refuse_bodies))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES));
    Ok((bound, tokio::spawn(serve(listener, app, stop))))
}

async fn serve(listener: TcpListener, app: Router, mut stop: watch::Receiver<bool>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut conns = JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.changed() => break,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of file descriptors and the like: pause rather than spin.
                tracing::debug!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(stream); // too many connections
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        let mut stop = stop.clone();
        conns.spawn(async move {
            let _slot = slot;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => if let Err(e) = r {
                    tracing::debug!("http connection: {e}");
                },
                _ = tokio::time::sleep(CONNECTION_LIFETIME) => {}
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(1), conn).await;
                }
            }
        });
    }
    conns.shutdown().await;
}
