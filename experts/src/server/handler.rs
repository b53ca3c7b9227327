//! Serving client streams: the accept loop, one task per stream, and the handling of each
//! request (validation, submission to the task pool, encoding the answer).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use futures::{AsyncWriteExt, StreamExt};
use starling_compression::{ChunkHeader, Codec};
use starling_node::{PeerId, Stream};
use tokio::sync::{oneshot, watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::timeout;
use tracing::debug;

use super::batcher::{Kind, Task};
use super::runtime::expert_info;
use super::Shared;
use crate::error::RemoteErrorKind;
use crate::wire::{read_msg, write_msg, FrameError, Request, Response, WireTensor};
use crate::Result;

pub(super) async fn accept_loop(
    shared: Arc<Shared>,
    mut incoming: starling_node::IncomingStreams,
    mut stop: watch::Receiver<bool>,
) {
    let limit = Arc::new(Semaphore::new(shared.cfg.max_streams));
    let mut handlers = JoinSet::new();
    loop {
        tokio::select! {
            s = incoming.next() => {
                let Some((peer, stream)) = s else { break };
                let Ok(permit) = limit.clone().try_acquire_owned() else {
                    debug!(%peer, "too many expert streams; dropping a new one");
                    continue;
                };
                let shared = shared.clone();
                let stop = stop.clone();
                handlers.spawn(async move {
                    let _permit = permit;
                    serve_stream(shared, peer, stream, stop).await;
                });
            }
            Some(_) = handlers.join_next(), if !handlers.is_empty() => {}
            _ = stop.changed() => break,
        }
    }
    handlers.shutdown().await;
}

pub(super) async fn serve_stream(
    shared: Arc<Shared>,
    peer: PeerId,
    mut stream: Stream,
    mut stop: watch::Receiver<bool>,
) {
    let cfg = &shared.cfg;
    match timeout(
        cfg.handshake_timeout,
        read_msg::<_, Request>(&mut stream, 1024),
    )
    .await
    {
        Ok(Ok(Request::Hello)) => {
            if write_msg(&mut stream, &Response::Ready).await.is_err() {
                return;
            }
        }
        _ => return,
    }
    loop {
        let req = tokio::select! {
            r = timeout(cfg.idle_timeout, read_msg::<_, Request>(&mut stream, cfg.max_frame_bytes)) => r,
            _ = stop.changed() => break,
        };
        let response = match req {
            Err(_) => break, // idle
            Ok(Err(FrameError::Io(_))) => return,
            Ok(Err(FrameError::TooLarge { len: n, .. })) => {
                shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                let msg = format!(
                    "request of {n} bytes exceeds the limit of {} bytes",
                    cfg.max_frame_bytes
                );
                debug!(%peer, "{msg}");
                let _ = write_msg(
                    &mut stream,
                    &Response::Error {
                        kind: RemoteErrorKind::TooLarge,
                        message: msg,
                    },
                )
                .await;
                // The body was not read; the stream cannot be resynchronised.
                break;
            }
            Ok(Err(FrameError::Malformed(m))) => Err((RemoteErrorKind::Malformed, m)),
            Ok(Ok(req)) => handle(&shared, req).await,
        };
        let response = match response {
            Ok(r) => {
                shared.stats.served.fetch_add(1, Ordering::Relaxed);
                r
            }
            Err((kind, message)) => {
                shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                debug!(%peer, ?kind, "refused: {message}");
                Response::Error { kind, message }
            }
        };
        if write_msg(&mut stream, &response).await.is_err() {
            return;
        }
    }
    let _ = stream.close().await;
}

pub(super) type Handled = std::result::Result<Response, (RemoteErrorKind, String)>;

pub(super) async fn handle(shared: &Shared, req: Request) -> Handled {
    let (uid, kind, inputs, grads) = match req {
        Request::Hello => return Ok(Response::Ready),
        Request::Info { uid } => {
            return expert_info(shared, &uid).await.map(Response::Info).ok_or((
                RemoteErrorKind::UnknownExpert,
                format!("no expert {uid} here"),
            ))
        }
        Request::Forward { uid, inputs } => (uid, Kind::Forward, inputs, None),
        Request::Backward {
            uid,
            inputs,
            grad_outputs,
        } => (uid, Kind::Backward, inputs, Some(grad_outputs)),
    };
    let hosted = shared.hosted.get(&uid).ok_or_else(|| {
        (
            RemoteErrorKind::UnknownExpert,
            format!("no expert {uid} here"),
        )
    })?;
    let cfg = &shared.cfg;
    let bad_schema = |m: String| (RemoteErrorKind::BadSchema, m);
    let one = |ts: Vec<WireTensor>, what: &str| {
        let n = ts.len();
        let mut it = ts.into_iter();
        match (it.next(), n) {
            (Some(t), 1) => Ok(t),
            _ => Err(bad_schema(format!("{what}: expected 1 tensor, got {n}"))),
        }
    };
    let x = one(inputs, "inputs")?;
    let reply_codec = ChunkHeader::parse_prefix(&x.frame)
        .map(|h| h.codec)
        .unwrap_or(Codec::None);
    let rows = hosted
        .schema
        .input
        .check_batch("input", &x.dims(), x.dtype)
        .map_err(|e| bad_schema(e.to_string()))?;
    if rows > cfg.max_request_rows {
        return Err((
            RemoteErrorKind::TooLarge,
            format!(
                "{rows} samples; this server takes at most {}",
                cfg.max_request_rows
            ),
        ));
    }
    let to_tensor = |t: &WireTensor| -> std::result::Result<Tensor, (RemoteErrorKind, String)> {
        let values = t
            .decode()
            .map_err(|e| (RemoteErrorKind::Malformed, e.to_string()))?;
        Tensor::from_vec(values, t.dims(), &Device::Cpu)
            .map_err(|e| (RemoteErrorKind::Malformed, e.to_string()))
    };
    let inputs = to_tensor(&x)?;
    let grads = match grads {
        Some(g) => {
            let g = one(g, "output gradients")?;
            let g_rows = hosted
                .schema
                .output
                .check_batch("output gradient", &g.dims(), g.dtype)
                .map_err(|e| bad_schema(e.to_string()))?;
            if g_rows != rows {
                return Err(bad_schema(format!(
                    "{g_rows} gradient rows for {rows} input rows"
                )));
            }
            Some(to_tensor(&g)?)
        }
        None => None,
    };
    let (tx, rx) = oneshot::channel();
    let task = Task {
        inputs,
        grads,
        rows,
        reply: tx,
    };
    match kind {
        Kind::Forward => hosted.forward.submit(task)?,
        Kind::Backward => hosted.backward.submit(task)?,
    }
    let out = match timeout(cfg.compute_timeout, rx).await {
        Ok(Ok(r)) => r?,
        Ok(Err(_)) => {
            return Err((
                RemoteErrorKind::ShuttingDown,
                "the server is stopping".into(),
            ))
        }
        Err(_) => {
            return Err((
                RemoteErrorKind::Overloaded,
                "not computed within the compute timeout".into(),
            ))
        }
    };
    let encode = || -> Result<WireTensor> {
        let dims = out.dims().to_vec();
        let values = out.flatten_all()?.to_vec1::<f32>()?;
        WireTensor::encode(&dims, &values, reply_codec)
    };
    match encode() {
        Ok(t) => Ok(Response::Tensors(vec![t])),
        Err(e) => Err((
            RemoteErrorKind::Internal,
            format!("cannot encode the result: {e}"),
        )),
    }
}
