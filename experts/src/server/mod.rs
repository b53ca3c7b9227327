//! The expert server: accepts calls, batches them per expert, runs batches on one compute
//! thread, declares its experts in the DHT and checkpoints them.
//!
//! ```text
//! stream handlers ──submit──► task pool (uid, forward|backward) ──batch──► runtime thread
//!   (one per client stream)     bounded by rows; full = Overloaded      owns every Expert
//! ```
//!
//! - `handler`: admission, the hello (through `starling_node::streams::serve_inbound`) and the
//!   request loop of each stream; `request`: checking, queueing and answering one request;
//! - `batcher`: the per-expert queues and the tasks that group them into batches;
//! - `runtime`: the compute thread, which owns the experts;
//! - `declare`: DHT declarations and periodic checkpoints.
//!
//! Every task and the runtime thread run in the span `experts_server{peer}`; all of them stop
//! on one `watch` signal, which [`ExpertServer::shutdown`] sends and then waits out.

mod batcher;
mod declare;
mod handler;
mod metrics;
mod request;
mod runtime;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use starling_node::Node;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{info, Instrument};

use crate::activations::ActivationReuse;
use crate::backend::Expert;
use crate::grid::ExpertUid;
use crate::schema::ExpertSchema;
use crate::wire::{ExpertInfo, EXPERTS_PROTOCOL};
use crate::{ExpertError, Result};

use batcher::{batcher, Kind, Pool};
use declare::{checkpoint_loop, declare_loop};
use handler::accept_loop;
use runtime::{checkpoint_path, expert_info, run_runtime, save_all, Job};

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
    /// Forward activations kept for backwards ([`ActivationReuse`]); `max_bytes` is for the
    /// whole server, shared equally by the hosted experts.
    pub activation_reuse: ActivationReuse,
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
            activation_reuse: ActivationReuse::default(),
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
    /// Nanoseconds spent in forward batches.
    pub forward_ns: AtomicU64,
    /// Nanoseconds backward batches spent recomputing the forward.
    pub recompute_ns: AtomicU64,
    /// Nanoseconds backward batches spent on gradients.
    pub gradients_ns: AtomicU64,
    /// Nanoseconds backward batches spent in the optimizer.
    pub optimizer_ns: AtomicU64,
    /// Samples of backward batches.
    pub backward_rows: AtomicU64,
    /// Backward samples whose forward activations were reused, not recomputed.
    pub reused_rows: AtomicU64,
}

impl ServerStats {
    /// Adds one batch's compute time to the per-phase totals.
    pub(super) fn record_phases(
        &self,
        forward: bool,
        rows: usize,
        total: std::time::Duration,
        backward: crate::BackwardPhases,
    ) {
        let ns = |d: std::time::Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        match forward {
            true => {
                self.forward_ns.fetch_add(ns(total), Ordering::Relaxed);
            }
            false => {
                self.recompute_ns
                    .fetch_add(ns(backward.recompute), Ordering::Relaxed);
                self.gradients_ns
                    .fetch_add(ns(backward.gradients), Ordering::Relaxed);
                self.optimizer_ns
                    .fetch_add(ns(backward.optimizer), Ordering::Relaxed);
                self.reused_rows
                    .fetch_add(backward.reused_rows as u64, Ordering::Relaxed);
                self.backward_rows.fetch_add(rows as u64, Ordering::Relaxed);
            }
        }
    }
}

/// Checks the settings and the experts (valid, distinct uids), creates the checkpoint directory
/// and restores every expert that has a checkpoint there.
fn restore(experts: Vec<(String, Expert)>, cfg: &ServerConfig) -> Result<HashMap<String, Expert>> {
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
    let reuse = ActivationReuse {
        max_bytes: cfg.activation_reuse.max_bytes / experts.len(),
        ..cfg.activation_reuse
    };
    for (uid, mut expert) in experts {
        ExpertUid::parse(&uid)?;
        expert.set_activation_reuse(reuse);
        if let Some(dir) = &cfg.checkpoint_dir {
            let path = checkpoint_path(dir, &uid);
            if path.exists() {
                expert.load(&path)?;
                info!(%uid, path = %path.display(), "restored expert from checkpoint");
            }
        }
        if owned.contains_key(&uid) {
            return Err(ExpertError::Invalid(format!("uid {uid} given twice")));
        }
        owned.insert(uid, expert);
    }
    Ok(owned)
}

/// One hosted expert as the stream handlers see it: its schema and its two queues.
struct Hosted {
    schema: ExpertSchema,
    forward: Pool,
    backward: Pool,
}

impl Hosted {
    /// Its queue of `kind` tasks.
    fn pool(&self, kind: Kind) -> &Pool {
        match kind {
            Kind::Forward => &self.forward,
            Kind::Backward => &self.backward,
        }
    }
}

/// What the server's tasks share: settings, the hosted experts' queues, the runtime's inbox.
struct Shared {
    cfg: ServerConfig,
    hosted: HashMap<String, Hosted>,
    runtime: mpsc::Sender<Job>,
    stats: Arc<ServerStats>,
    metrics: metrics::ExpertMetrics,
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
    /// the batching pools, accepts calls and declares the experts in the DHT. Everything the
    /// server logs is inside a span `experts_server{peer}`.
    pub async fn start(
        node: Node,
        experts: Vec<(String, Expert)>,
        cfg: ServerConfig,
    ) -> Result<ExpertServer> {
        let span = tracing::info_span!("experts_server", peer = %node.peer_id());
        // Starting only checks, loads and spawns (no await), so it can run inside the span.
        span.in_scope(|| ExpertServer::launch(node, experts, cfg))
    }

    /// [`Self::start`], inside the server's span: every task and the runtime thread inherit it.
    fn launch(node: Node, experts: Vec<(String, Expert)>, cfg: ServerConfig) -> Result<Self> {
        let owned = restore(experts, &cfg)?;
        let mut uids: Vec<String> = owned.keys().cloned().collect();
        uids.sort();
        let (stop, stop_rx) = watch::channel(false);
        let (rt_tx, rt_rx) = mpsc::channel::<Job>(4 * owned.len().max(4));
        let stats = Arc::new(ServerStats::default());
        let mut tasks = Vec::new();
        let mut hosted = HashMap::new();
        for (uid, expert) in &owned {
            let uid_arc: Arc<str> = Arc::from(uid.as_str());
            let mut pool = |kind| {
                let (pool, rx) = Pool::new(&cfg);
                let batching = batcher(
                    uid_arc.clone(),
                    kind,
                    rx,
                    pool.queued_rows.clone(),
                    rt_tx.clone(),
                    cfg.clone(),
                    stop_rx.clone(),
                );
                tasks.push(tokio::spawn(batching.in_current_span()));
                pool
            };
            let forward = pool(Kind::Forward);
            let backward = pool(Kind::Backward);
            let schema = expert.schema().clone();
            hosted.insert(
                uid.clone(),
                Hosted {
                    schema,
                    forward,
                    backward,
                },
            );
        }
        let runtime = {
            let stats = stats.clone();
            let max_request_rows = cfg.max_request_rows;
            let span = tracing::Span::current();
            std::thread::Builder::new()
                .name("starling-experts-runtime".into())
                .spawn(move || {
                    span.in_scope(|| run_runtime(owned, rt_rx, stats, max_request_rows))
                })?
        };
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            hosted,
            runtime: rt_tx,
            stats,
            metrics: metrics::ExpertMetrics::of(node.metrics()),
        });
        node.metrics().set_section(&crate::ExpertsBoard::new(&uids));
        let incoming = node
            .stream_control()
            .accept(EXPERTS_PROTOCOL)
            .map_err(|e| ExpertError::Protocol(format!("cannot accept expert calls: {e}")))?;
        let accepting = accept_loop(shared.clone(), incoming, stop_rx.clone());
        tasks.push(tokio::spawn(accepting.in_current_span()));
        let declaring = declare_loop(node.clone(), uids.clone(), cfg.clone(), stop_rx.clone());
        tasks.push(tokio::spawn(declaring.in_current_span()));
        if let Some(dir) = cfg.checkpoint_dir.clone() {
            let checkpointing = checkpoint_loop(shared.clone(), dir, stop_rx.clone());
            tasks.push(tokio::spawn(checkpointing.in_current_span()));
        }
        info!(experts = uids.len(), "expert server started");
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

    /// Stops accepting calls, ends every task (stream handlers drop their streams at once),
    /// checkpoints (when configured) and stops the runtime thread after the batches already
    /// queued for it. The node itself keeps running; shut it down separately.
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
