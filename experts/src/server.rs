//! The expert server: accepts calls, batches them per expert, runs batches on one compute
//! thread, declares its experts in the DHT and checkpoints them.
//!
//! ```text
//! stream handlers ──submit──► task pool (uid, forward|backward) ──batch──► runtime thread
//!   (one per client stream)     bounded by rows; full = Overloaded      owns every Expert
//! ```

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};
use futures::{AsyncWriteExt, StreamExt};
use starling_compression::{ChunkHeader, Codec};
use starling_node::{Node, PeerId, Stream};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{timeout, Instant};
use tracing::{debug, info, warn};

use crate::backend::Expert;
use crate::error::RemoteErrorKind;
use crate::grid::{ExpertHost, ExpertUid};
use crate::schema::ExpertSchema;
use crate::wire::{
    read_msg, write_msg, ExpertInfo, ReadError, Request, Response, WireTensor, EXPERTS_PROTOCOL,
};
use crate::{ExpertError, Result};

/// Server settings. Every bound and timeout is here; `Default` suits a small server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Largest batch (samples) the runtime runs at once.
    pub max_batch_rows: usize,
    /// How long a pool waits for more requests after the first before running a batch.
    pub max_wait: Duration,
    /// Samples that may wait in one expert's forward (or backward) queue; beyond this the
    /// server answers `Overloaded`.
    pub max_queue_rows: usize,
    /// Largest request, in samples.
    pub max_request_rows: usize,
    /// Largest request frame, in bytes.
    pub max_frame_bytes: usize,
    /// Client streams served at once.
    pub max_streams: usize,
    /// Time for a new stream's hello.
    pub handshake_timeout: Duration,
    /// A stream idle this long is closed.
    pub idle_timeout: Duration,
    /// Longest time a request may wait for its batch to be computed.
    pub compute_timeout: Duration,
    /// Lifetime of a DHT declaration.
    pub declare_ttl: Duration,
    /// How often declarations are renewed (well below `declare_ttl`).
    pub declare_every: Duration,
    /// Where expert parameters are saved (`<dir>/<uid>.safetensors`) and restored from.
    pub checkpoint_dir: Option<PathBuf>,
    /// How often to checkpoint (also done on shutdown).
    pub checkpoint_every: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_batch_rows: 2048,
            max_wait: Duration::from_millis(2),
            max_queue_rows: 32_768,
            max_request_rows: 4096,
            max_frame_bytes: 128 << 20,
            max_streams: 1024,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            compute_timeout: Duration::from_secs(60),
            declare_ttl: Duration::from_secs(30),
            declare_every: Duration::from_secs(10),
            checkpoint_dir: None,
            checkpoint_every: Duration::from_secs(300),
        }
    }
}

/// Counters of a running server.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Requests answered with results.
    pub served: AtomicU64,
    /// Requests answered with an error.
    pub refused: AtomicU64,
    /// Batches run.
    pub batches: AtomicU64,
    /// Samples run (forward and backward).
    pub rows: AtomicU64,
}

/// What a task's submitter receives: the task's rows of the batch result, or an error.
type TaskResult = std::result::Result<Tensor, (RemoteErrorKind, String)>;
type Reply = oneshot::Sender<TaskResult>;

struct Task {
    inputs: Tensor,
    grads: Option<Tensor>,
    rows: usize,
    reply: Reply,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Forward,
    Backward,
}

/// One expert's queue of forward or backward tasks.
#[derive(Clone)]
struct Pool {
    tx: mpsc::Sender<Task>,
    queued_rows: Arc<AtomicUsize>,
    max_queue_rows: usize,
}

impl Pool {
    fn submit(&self, task: Task) -> std::result::Result<(), (RemoteErrorKind, String)> {
        let rows = task.rows;
        let before = self.queued_rows.fetch_add(rows, Ordering::AcqRel);
        if before + rows > self.max_queue_rows {
            self.queued_rows.fetch_sub(rows, Ordering::AcqRel);
            return Err((
                RemoteErrorKind::Overloaded,
                format!(
                    "{before} samples already queued (limit {})",
                    self.max_queue_rows
                ),
            ));
        }
        self.tx.try_send(task).map_err(|_| {
            self.queued_rows.fetch_sub(rows, Ordering::AcqRel);
            (RemoteErrorKind::Overloaded, "queue full".to_string())
        })
    }
}

struct Hosted {
    schema: ExpertSchema,
    forward: Pool,
    backward: Pool,
}

enum Job {
    Run {
        uid: Arc<str>,
        kind: Kind,
        tasks: Vec<Task>,
    },
    Info(String, oneshot::Sender<Option<ExpertInfo>>),
    Save(PathBuf, oneshot::Sender<Result<()>>),
    Stop,
}

struct Shared {
    cfg: ServerConfig,
    hosted: HashMap<String, Hosted>,
    runtime: mpsc::Sender<Job>,
    stats: Arc<ServerStats>,
}

/// A running expert server. Stop it with [`ExpertServer::shutdown`].
///
/// ```no_run
/// # async fn demo(node: starling_node::Node) -> starling_experts::Result<()> {
/// use starling_experts::{Expert, ExpertServer, ExpertSpec, ServerConfig, expand_uid_pattern};
/// let spec = ExpertSpec::ffn(256, 1024);
/// let experts = expand_uid_pattern("ffn.0.[0:8]")?
///     .into_iter()
///     .enumerate()
///     .map(|(i, uid)| Ok((uid, Expert::new(&spec, i as u64)?)))
///     .collect::<starling_experts::Result<Vec<_>>>()?;
/// let server = ExpertServer::start(node, experts, ServerConfig::default()).await?;
/// // ... serve until asked to stop ...
/// server.shutdown().await?;
/// # Ok(()) }
/// ```
pub struct ExpertServer {
    node: Node,
    uids: Vec<String>,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    runtime: Option<std::thread::JoinHandle<()>>,
}

impl ExpertServer {
    /// Starts serving `experts` (uid, expert) on `node`: restores each from
    /// `checkpoint_dir/<uid>.safetensors` when that file exists, starts the runtime thread and
    /// the batching pools, accepts calls and declares the experts in the DHT.
    pub async fn start(
        node: Node,
        experts: Vec<(String, Expert)>,
        cfg: ServerConfig,
    ) -> Result<ExpertServer> {
        if experts.is_empty() {
            return Err(ExpertError::Invalid("no experts to serve".into()));
        }
        if cfg.max_batch_rows == 0
            || cfg.max_request_rows == 0
            || cfg.max_queue_rows < cfg.max_request_rows
        {
            return Err(ExpertError::Invalid(
                "max_batch_rows and max_request_rows must be positive, max_queue_rows >= max_request_rows".into(),
            ));
        }
        if let Some(dir) = &cfg.checkpoint_dir {
            std::fs::create_dir_all(dir).map_err(|e| ExpertError::Checkpoint {
                path: dir.display().to_string(),
                message: e.to_string(),
            })?;
        }
        let mut owned = HashMap::new();
        let mut uids = Vec::new();
        for (uid, mut expert) in experts {
            ExpertUid::parse(&uid)?;
            if let Some(dir) = &cfg.checkpoint_dir {
                let path = checkpoint_path(dir, &uid);
                if path.exists() {
                    expert.load(&path)?;
                    info!(%uid, path = %path.display(), "restored expert from checkpoint");
                }
            }
            if owned.insert(uid.clone(), expert).is_some() {
                return Err(ExpertError::Invalid(format!("uid {uid} given twice")));
            }
            uids.push(uid);
        }
        uids.sort();
        let (stop, stop_rx) = watch::channel(false);
        let (rt_tx, rt_rx) = mpsc::channel::<Job>(4 * owned.len().max(4));
        let stats = Arc::new(ServerStats::default());
        let mut tasks = Vec::new();
        let mut hosted = HashMap::new();
        for (uid, expert) in &owned {
            let uid_arc: Arc<str> = Arc::from(uid.as_str());
            let mut pool = |kind| {
                let (tx, rx) = mpsc::channel(cfg.max_queue_rows.min(65_536));
                let queued_rows = Arc::new(AtomicUsize::new(0));
                tasks.push(tokio::spawn(batcher(
                    uid_arc.clone(),
                    kind,
                    rx,
                    queued_rows.clone(),
                    rt_tx.clone(),
                    cfg.clone(),
                    stop_rx.clone(),
                )));
                Pool {
                    tx,
                    queued_rows,
                    max_queue_rows: cfg.max_queue_rows,
                }
            };
            hosted.insert(
                uid.clone(),
                Hosted {
                    schema: expert.schema().clone(),
                    forward: pool(Kind::Forward),
                    backward: pool(Kind::Backward),
                },
            );
        }
        let runtime = {
            let stats = stats.clone();
            let max_request_rows = cfg.max_request_rows;
            std::thread::Builder::new()
                .name("starling-experts-runtime".into())
                .spawn(move || run_runtime(owned, rt_rx, stats, max_request_rows))?
        };
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            hosted,
            runtime: rt_tx,
            stats,
        });
        let incoming = node
            .stream_control()
            .accept(EXPERTS_PROTOCOL)
            .map_err(|e| ExpertError::Protocol(format!("cannot accept expert calls: {e}")))?;
        tasks.push(tokio::spawn(accept_loop(
            shared.clone(),
            incoming,
            stop_rx.clone(),
        )));
        tasks.push(tokio::spawn(declare_loop(
            node.clone(),
            uids.clone(),
            cfg.clone(),
            stop_rx.clone(),
        )));
        if let Some(dir) = cfg.checkpoint_dir.clone() {
            tasks.push(tokio::spawn(checkpoint_loop(
                shared.clone(),
                dir,
                stop_rx.clone(),
            )));
        }
        info!(experts = uids.len(), peer = %node.peer_id(), "expert server started");
        Ok(ExpertServer {
            node,
            uids,
            shared,
            stop,
            tasks,
            runtime: Some(runtime),
        })
    }

    /// The uids served, sorted.
    pub fn uids(&self) -> &[String] {
        &self.uids
    }

    /// The node it serves on.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// Live counters.
    pub fn stats(&self) -> &ServerStats {
        &self.shared.stats
    }

    /// Describes one hosted expert.
    pub async fn info(&self, uid: &str) -> Option<ExpertInfo> {
        expert_info(&self.shared, uid).await
    }

    /// Writes every expert's parameters to the checkpoint directory now.
    pub async fn checkpoint(&self) -> Result<()> {
        match &self.shared.cfg.checkpoint_dir {
            Some(dir) => save_all(&self.shared, dir.clone()).await,
            None => Err(ExpertError::Invalid(
                "no checkpoint directory configured".into(),
            )),
        }
    }

    /// Stops accepting calls, ends every task, checkpoints (when configured) and stops the
    /// runtime thread. The node itself keeps running; shut it down separately.
    pub async fn shutdown(mut self) -> Result<()> {
        let _ = self.stop.send(true);
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        let saved = match &self.shared.cfg.checkpoint_dir {
            Some(dir) => save_all(&self.shared, dir.clone()).await,
            None => Ok(()),
        };
        let _ = self.shared.runtime.send(Job::Stop).await;
        if let Some(rt) = self.runtime.take() {
            let _ = tokio::task::spawn_blocking(move || rt.join()).await;
        }
        saved
    }
}

impl Drop for ExpertServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn checkpoint_path(dir: &std::path::Path, uid: &str) -> PathBuf {
    dir.join(format!("{uid}.safetensors"))
}

async fn expert_info(shared: &Shared, uid: &str) -> Option<ExpertInfo> {
    let (tx, rx) = oneshot::channel();
    shared
        .runtime
        .send(Job::Info(uid.to_string(), tx))
        .await
        .ok()?;
    rx.await.ok().flatten()
}

async fn save_all(shared: &Shared, dir: PathBuf) -> Result<()> {
    let (tx, rx) = oneshot::channel();
    shared
        .runtime
        .send(Job::Save(dir, tx))
        .await
        .map_err(|_| ExpertError::Closed)?;
    rx.await.map_err(|_| ExpertError::Closed)?
}

/// Collects tasks into batches of at most `max_batch_rows`, waiting at most `max_wait` after the
/// first, and hands them to the runtime (waiting for room: backpressure).
async fn batcher(
    uid: Arc<str>,
    kind: Kind,
    mut rx: mpsc::Receiver<Task>,
    queued_rows: Arc<AtomicUsize>,
    runtime: mpsc::Sender<Job>,
    cfg: ServerConfig,
    mut stop: watch::Receiver<bool>,
) {
    let mut carry: Option<Task> = None;
    loop {
        let first = match carry.take() {
            Some(t) => t,
            None => tokio::select! {
                t = rx.recv() => match t { Some(t) => t, None => return },
                _ = stop.changed() => return,
            },
        };
        queued_rows.fetch_sub(first.rows, Ordering::AcqRel);
        let mut rows = first.rows;
        let mut batch = vec![first];
        let until = Instant::now() + cfg.max_wait;
        while rows < cfg.max_batch_rows {
            let next = match rx.try_recv() {
                Ok(t) => t,
                Err(mpsc::error::TryRecvError::Empty) => {
                    match tokio::time::timeout_at(until, rx.recv()).await {
                        Ok(Some(t)) => t,
                        _ => break,
                    }
                }
                Err(_) => break,
            };
            queued_rows.fetch_sub(next.rows, Ordering::AcqRel);
            if rows + next.rows > cfg.max_batch_rows {
                // Counted as taken; give the count back while it waits for the next batch.
                queued_rows.fetch_add(next.rows, Ordering::AcqRel);
                carry = Some(next);
                break;
            }
            rows += next.rows;
            batch.push(next);
        }
        batch.retain(|t| !t.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        let job = Job::Run {
            uid: uid.clone(),
            kind,
            tasks: batch,
        };
        tokio::select! {
            r = runtime.send(job) => if r.is_err() { return },
            _ = stop.changed() => return,
        }
    }
}

/// The compute thread: owns every expert, runs batches in arrival order.
fn run_runtime(
    mut experts: HashMap<String, Expert>,
    mut jobs: mpsc::Receiver<Job>,
    stats: Arc<ServerStats>,
    max_request_rows: usize,
) {
    while let Some(job) = jobs.blocking_recv() {
        match job {
            Job::Run { uid, kind, tasks } => {
                let Some(expert) = experts.get_mut(&*uid) else {
                    continue;
                };
                let rows: usize = tasks.iter().map(|t| t.rows).sum();
                let result = run_batch(expert, kind, &tasks);
                stats.batches.fetch_add(1, Ordering::Relaxed);
                stats.rows.fetch_add(rows as u64, Ordering::Relaxed);
                match result {
                    Ok(out) => {
                        let mut offset = 0;
                        for t in tasks {
                            let part = out
                                .narrow(0, offset, t.rows)
                                .map_err(|e| (RemoteErrorKind::Internal, e.to_string()));
                            offset += t.rows;
                            let _ = t.reply.send(part);
                        }
                    }
                    Err(e) => {
                        warn!(%uid, ?kind, "batch failed: {e}");
                        for t in tasks {
                            let _ = t
                                .reply
                                .send(Err((RemoteErrorKind::Internal, e.to_string())));
                        }
                    }
                }
            }
            Job::Info(uid, reply) => {
                let info = experts.get(&uid).map(|e| ExpertInfo {
                    uid: uid.clone(),
                    spec: e.spec().clone(),
                    schema: e.schema().clone(),
                    steps: e.steps(),
                    max_request_rows,
                });
                let _ = reply.send(info);
            }
            Job::Stop => break,
            Job::Save(dir, reply) => {
                let mut result = Ok(());
                for (uid, e) in &experts {
                    if let Err(err) = e.save(&checkpoint_path(&dir, uid)) {
                        warn!(%uid, "checkpoint failed: {err}");
                        result = Err(err);
                    }
                }
                let _ = reply.send(result);
            }
        }
    }
}

fn run_batch(expert: &mut Expert, kind: Kind, tasks: &[Task]) -> Result<Tensor> {
    let cat = |ts: Vec<&Tensor>| -> Result<Tensor> {
        if ts.len() == 1 {
            Ok(ts[0].clone())
        } else {
            Ok(Tensor::cat(&ts, 0)?)
        }
    };
    let x = cat(tasks.iter().map(|t| &t.inputs).collect())?;
    match kind {
        Kind::Forward => expert.forward(&x),
        Kind::Backward => {
            let g = cat(tasks.iter().filter_map(|t| t.grads.as_ref()).collect())?;
            expert.backward(&x, &g)
        }
    }
}

async fn accept_loop(
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

async fn serve_stream(
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
            Ok(Err(ReadError::Io(_))) => return,
            Ok(Err(ReadError::TooLarge(n))) => {
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
            Ok(Err(ReadError::Malformed(m))) => Err((RemoteErrorKind::Malformed, m)),
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

type Handled = std::result::Result<Response, (RemoteErrorKind, String)>;

async fn handle(shared: &Shared, req: Request) -> Handled {
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

/// Declares every uid under every prefix, now and every `declare_every`.
async fn declare_loop(
    node: Node,
    uids: Vec<String>,
    cfg: ServerConfig,
    mut stop: watch::Receiver<bool>,
) {
    let marker = node.owner_marker();
    let mut pairs: Vec<(String, String)> = uids
        .iter()
        .filter_map(|u| ExpertUid::parse(u).ok())
        .flat_map(|u| {
            (0..u.coords.len())
                .map(|l| u.declaration_at(l, &marker))
                .collect::<Vec<_>>()
        })
        .collect();
    pairs.sort();
    pairs.dedup();
    loop {
        let host = ExpertHost {
            peer: node.peer_id().to_bytes(),
            addrs: node
                .listen_addrs()
                .await
                .unwrap_or_default()
                .iter()
                .map(|a| a.to_string())
                .collect(),
        };
        let expiration = starling_dht::now_ms() + cfg.declare_ttl.as_millis() as u64;
        let puts = pairs.iter().map(|(key, sub)| {
            let node = node.clone();
            let host = host.clone();
            async move { node.store(key, sub, &host, expiration).await }
        });
        let results = tokio::select! {
            r = futures::future::join_all(puts) => r,
            _ = stop.changed() => return,
        };
        let failed = results.iter().filter(|r| r.is_err()).count();
        if failed > 0 {
            debug!(
                failed,
                total = pairs.len(),
                "some expert declarations failed"
            );
        }
        tokio::select! {
            _ = tokio::time::sleep(cfg.declare_every) => {}
            _ = stop.changed() => return,
        }
    }
}

async fn checkpoint_loop(shared: Arc<Shared>, dir: PathBuf, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(shared.cfg.checkpoint_every) => {}
            _ = stop.changed() => return,
        }
        if let Err(e) = save_all(&shared, dir.clone()).await {
            warn!("periodic checkpoint failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(rows: usize) -> (Task, oneshot::Receiver<TaskResult>) {
        let (tx, rx) = oneshot::channel();
        let t = Task {
            inputs: Tensor::zeros((rows, 2), candle_core::DType::F32, &Device::Cpu).unwrap(),
            grads: None,
            rows,
            reply: tx,
        };
        (t, rx)
    }

    #[test]
    fn a_pool_refuses_work_beyond_its_bound() {
        let (tx, mut rx) = mpsc::channel(100);
        let pool = Pool {
            tx,
            queued_rows: Arc::new(AtomicUsize::new(0)),
            max_queue_rows: 10,
        };
        let mut replies = Vec::new();
        for _ in 0..2 {
            let (t, r) = task(4);
            replies.push(r);
            assert!(pool.submit(t).is_ok());
        }
        let (t, _r) = task(4);
        let err = pool.submit(t).unwrap_err();
        assert_eq!(err.0, RemoteErrorKind::Overloaded);
        assert_eq!(pool.queued_rows.load(Ordering::Acquire), 8);
        // Once the batcher takes work, room frees up.
        let taken = rx.try_recv().unwrap();
        pool.queued_rows.fetch_sub(taken.rows, Ordering::AcqRel);
        let (t, _r) = task(4);
        assert!(pool.submit(t).is_ok());
    }

    #[tokio::test]
    async fn the_batcher_groups_tasks_up_to_the_batch_limit() {
        let (tx, rx) = mpsc::channel(100);
        let queued = Arc::new(AtomicUsize::new(0));
        let pool = Pool {
            tx,
            queued_rows: queued.clone(),
            max_queue_rows: 1000,
        };
        let mut replies = Vec::new();
        for _ in 0..5 {
            let (t, r) = task(3);
            replies.push(r);
            pool.submit(t).unwrap();
        }
        let (rt_tx, mut rt_rx) = mpsc::channel(10);
        let (_stop_tx, stop_rx) = watch::channel(false);
        let cfg = ServerConfig {
            max_batch_rows: 8,
            max_wait: Duration::from_millis(20),
            ..ServerConfig::default()
        };
        let handle = tokio::spawn(batcher(
            Arc::from("e.0"),
            Kind::Forward,
            rx,
            queued.clone(),
            rt_tx,
            cfg,
            stop_rx,
        ));
        let mut sizes = Vec::new();
        while sizes.iter().sum::<usize>() < 15 {
            match rt_rx.recv().await.unwrap() {
                Job::Run { tasks, kind, .. } => {
                    assert_eq!(kind, Kind::Forward);
                    sizes.push(tasks.iter().map(|t| t.rows).sum());
                }
                _ => panic!("unexpected job"),
            }
        }
        assert_eq!(sizes, vec![6, 6, 3]);
        assert_eq!(queued.load(Ordering::Acquire), 0);
        handle.abort();
    }
}
