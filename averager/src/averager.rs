use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde::de::DeserializeOwned;
use starling_node::{Multiaddr, Node, PeerId, Reachability, Stream, StreamProtocol};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};

use crate::allreduce::{run_allreduce, IncomingSender, RoundRoute};
use crate::lane::Lane;
use crate::matchmaking::{find_group, IncomingJoin};
use crate::pool::BufPool;
use crate::wire::{
    read_control, write_control, MatchMsg, MemberInfo, ReduceMsg, RejectReason,
    MATCHMAKING_PROTOCOL, REDUCE_PROTOCOL, UNKNOWN_ROUND,
};
use crate::{AveragerConfig, AveragerError, AveragingMode, RoundReport};

/// Inbound streams being read at once, per protocol (bounds tasks and buffers).
const MAX_INBOUND_HANDSHAKES: usize = 256;
/// How long an inbound reduce stream waits for its round to be registered locally (the reducer
/// may learn of the round a little after the sender).
const ROUND_ROUTE_WAIT: Duration = Duration::from_millis(20);
/// Elements flattened and checked at a time (fits in L1/L2).
const FLATTEN_PIECE: usize = 8192;
/// How long a peer whose fast lane failed is reached over libp2p streams only.
const LANE_RETRY_AFTER: Duration = Duration::from_secs(300);
/// Peers remembered as having no usable fast lane, at most.
const MAX_LANE_FAILURES: usize = 4096;
/// Weight of a new bandwidth measurement in the running average.
const BANDWIDTH_EMA: f64 = 0.3;

/// State shared by the averager handle, its accept loops and running rounds.
pub(crate) struct Shared {
    pub node: Node,
    pub config: AveragerConfig,
    pub join_routes: Mutex<HashMap<String, mpsc::Sender<IncomingJoin>>>,
    pub round_routes: Mutex<HashMap<u64, RoundRoute>>,
    /// Measured upload rate (bytes/s); `None` until the first measurement.
    bandwidth: Mutex<Option<f64>>,
    grid_index: Mutex<u32>,
    /// The last round's background repair server (see `allreduce`): at most one at a time.
    repair_server: Mutex<Option<JoinHandle<()>>>,
    /// Peers whose fast lane failed recently, and when.
    lane_failures: Mutex<HashMap<PeerId, Instant>>,
    /// Model-sized buffers kept from round to round.
    pub pool: Arc<BufPool>,
}

impl Shared {
    /// Opens a stream to `peer`, dialing one of `addrs` first if the peer is not reachable yet.
    pub async fn open_stream(
        &self,
        peer: PeerId,
        addrs: &[String],
        protocol: StreamProtocol,
    ) -> Result<Stream, AveragerError> {
        let t = self.config.request_timeout;
        let mut control = self.node.stream_control();
        if let Ok(Ok(s)) = timeout(t, control.open_stream(peer, protocol.clone())).await {
            return Ok(s);
        }
        self.dial_any(addrs).await;
        match timeout(t, control.open_stream(peer, protocol)).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(AveragerError::Protocol(format!(
                "cannot open a stream to {peer}: {e}"
            ))),
            Err(_) => Err(AveragerError::Deadline("opening a stream")),
        }
    }

    /// Dials the first of `addrs` that answers.
    async fn dial_any(&self, addrs: &[String]) {
        for a in addrs {
            if let Ok(addr) = a.parse::<Multiaddr>() {
                if self.node.dial(addr).await.is_ok() {
                    break;
                }
            }
        }
    }

    /// Opens a reduce exchange's stream to `peer`: a fast lane if the configuration allows one
    /// and the peer's lane has not failed recently, else a libp2p stream.
    pub async fn open_lane(
        &self,
        peer: PeerId,
        addrs: &[String],
        protocol: StreamProtocol,
    ) -> Result<Lane, AveragerError> {
        let recently_failed = self
            .lane_failures
            .lock()
            .ok()
            .and_then(|f| f.get(&peer).copied())
            .is_some_and(|at| at.elapsed() < LANE_RETRY_AFTER);
        if self.config.fast_lane && !recently_failed {
            // A lane is asked for over a direct connection: make one if there is none yet. If
            // that fails, libp2p may still find a way (other addresses, a relay): no lane this
            // time, but that is no reason to stop asking the peer for one.
            let mut connected = self.node.connected_peers().await?.contains(&peer);
            if !connected {
                self.dial_any(addrs).await;
                connected = self.node.connected_peers().await?.contains(&peer);
            }
            match self.node.open_fast(peer, protocol.clone()).await {
                Ok(s) => return Ok(Lane::Fast(Box::new(s))),
                Err(e) if !connected => {
                    tracing::debug!(%peer, "not connected directly, no fast lane this time: {e}");
                }
                Err(e) => {
                    tracing::debug!(%peer, "no fast lane, using libp2p streams: {e}");
                    if let Ok(mut f) = self.lane_failures.lock() {
                        f.retain(|_, at| at.elapsed() < LANE_RETRY_AFTER);
                        if f.len() < MAX_LANE_FAILURES {
                            f.insert(peer, Instant::now());
                        }
                    }
                }
            }
        }
        self.open_stream(peer, addrs, protocol).await.map(Lane::P2p)
    }

    /// Keeps `server` (a finished round serving other members' re-delegated parts), ending the
    /// previous one: one lingering round at a time bounds the memory and tasks it holds.
    pub fn set_repair_server(&self, server: JoinHandle<()>) {
        if let Ok(mut s) = self.repair_server.lock() {
            if let Some(old) = s.replace(server) {
                old.abort();
            }
        }
    }

    /// Ends the background repair server, if any.
    fn stop_repair_server(&self) {
        if let Ok(mut s) = self.repair_server.lock() {
            if let Some(old) = s.take() {
                old.abort();
            }
        }
    }

    pub fn bandwidth(&self) -> f64 {
        self.config
            .bandwidth
            .or_else(|| self.bandwidth.lock().ok().and_then(|b| *b))
            .unwrap_or(self.config.initial_bandwidth)
    }

    /// Folds a measured upload rate (bytes/s, from this round's sender streams) into the
    /// running estimate that the next rounds declare.
    fn record_bandwidth(&self, measured: Option<f64>) {
        let Some(measured) = measured.filter(|m| m.is_finite() && *m > 0.0) else {
            return;
        };
        if let Ok(mut b) = self.bandwidth.lock() {
            // The first measurement replaces the initial guess outright; later ones are smoothed.
            *b = Some(match *b {
                None => measured,
                Some(old) => (1.0 - BANDWIDTH_EMA) * old + BANDWIDTH_EMA * measured,
            });
        }
    }
}

/// Averages flat `f32` tensors with other peers of the swarm.
///
/// One call to [`Averager::step`] finds a group through the DHT and runs a butterfly
/// all-reduce with it; the tensors are replaced by the group's weighted mean (on the spans
/// that could be averaged, see [`RoundReport`]) only when the round completes.
///
/// ```no_run
/// # async fn train() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::{Duration, Instant};
/// use starling_averager::{Averager, AveragerConfig};
/// use starling_node::{Node, NodeConfig};
///
/// let node = Node::start(NodeConfig::default()).await?;
/// let averager = Averager::new(node, AveragerConfig::new("my-run")).await?;
/// let mut weights = vec![0.0f32; 1000];
/// let mut bias = vec![0.0f32; 10];
/// for step in 0..100 {
///     // ... a local optimizer step updates `weights` and `bias` ...
///     if step % 10 == 9 {
///         let deadline = Instant::now() + Duration::from_secs(30);
///         match averager.step(&mut [&mut weights[..], &mut bias[..]], 1.0, deadline).await {
///             Ok(report) => println!("averaged with {} peers", report.group.len()),
///             Err(e) => eprintln!("no averaging this time: {e}"), // training goes on
///         }
///     }
/// }
/// averager.shutdown().await;
/// # Ok(()) }
/// ```
pub struct Averager {
    shared: Arc<Shared>,
    busy: AtomicBool,
    tasks: Vec<JoinHandle<()>>,
}

impl Averager {
    /// Starts serving the averaging protocols on `node`. One averager per node.
    pub async fn new(node: Node, config: AveragerConfig) -> Result<Self, AveragerError> {
        config.validate()?;
        let mut control = node.stream_control();
        let joins = control
            .accept(MATCHMAKING_PROTOCOL)
            .map_err(|_| AveragerError::AlreadyRunning)?;
        let reduces = control
            .accept(REDUCE_PROTOCOL)
            .map_err(|_| AveragerError::AlreadyRunning)?;
        let grid = if config.group_bits == 0 {
            0
        } else {
            rand::random::<u32>() % (1 << config.group_bits)
        };
        let shared = Arc::new(Shared {
            node,
            bandwidth: Mutex::new(None),
            config,
            join_routes: Mutex::new(HashMap::new()),
            round_routes: Mutex::new(HashMap::new()),
            grid_index: Mutex::new(grid),
            repair_server: Mutex::new(None),
            lane_failures: Mutex::new(HashMap::new()),
            pool: Arc::new(BufPool::default()),
        });
        let reduces = reduces.map(|(peer, s)| (peer, Lane::P2p(s)));
        let mut tasks = vec![
            tokio::spawn(serve_inbound(shared.clone(), joins, on_join)),
            tokio::spawn(serve_inbound(shared.clone(), reduces, on_reduce)),
        ];
        // Senders reach a reducer over its fast lane when it has one (never in client mode).
        if shared.config.fast_lane && shared.node.fast_lane_port().is_some() {
            let mut lanes = shared
                .node
                .accept_fast(REDUCE_PROTOCOL)
                .map_err(|_| AveragerError::AlreadyRunning)?;
            let lanes = futures::stream::poll_fn(move |cx| lanes.poll_recv(cx))
                .map(|(peer, s)| (peer, Lane::Fast(Box::new(s))));
            tasks.push(tokio::spawn(serve_inbound(
                shared.clone(),
                lanes,
                on_reduce,
            )));
        }
        Ok(Averager {
            shared,
            busy: AtomicBool::new(false),
            tasks,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &AveragerConfig {
        &self.shared.config
    }

    /// The bandwidth this peer currently declares (bytes per second).
    pub fn bandwidth(&self) -> f64 {
        self.shared.bandwidth()
    }

    /// Finds a group and averages `tensors` with it, weighted by `weight` (e.g. the number of
    /// samples behind this peer's update), finishing before `deadline`. The tensors change only
    /// if the round completes, and only on the spans the report lists as averaged.
    pub async fn step(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: std::time::Instant,
    ) -> Result<RoundReport, AveragerError> {
        if self.busy.swap(true, Ordering::AcqRel) {
            return Err(AveragerError::Config(
                "a step is already running on this averager".into(),
            ));
        }
        let result = self
            .step_inner(tensors, weight, Instant::from_std(deadline))
            .await;
        self.busy.store(false, Ordering::Release);
        result
    }

    /// The mode to declare this round: a `Node` peer that cannot accept connections (its node
    /// runs in client mode, or autonat found it behind a NAT) takes part as a `Client`, so that
    /// nobody waits on a reducer it cannot reach.
    async fn effective_mode(&self) -> AveragingMode {
        let cfg = &self.shared.config;
        let reachability = self.shared.node.status().await.map(|s| s.reachability);
        match (cfg.mode, reachability) {
            (AveragingMode::Node, Ok(Reachability::Client | Reachability::Private)) => {
                tracing::debug!("this node accepts no inbound connections: averaging as a client");
                AveragingMode::Client
            }
            (AveragingMode::Aux, Ok(Reachability::Client | Reachability::Private)) => {
                tracing::warn!(
                    "an Aux averager behind a NAT or in client mode cannot be reached to reduce"
                );
                AveragingMode::Aux
            }
            (mode, _) => mode,
        }
    }

    async fn step_inner(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: Instant,
    ) -> Result<RoundReport, AveragerError> {
        let cfg = &self.shared.config;
        if !(weight.is_finite() && weight >= 0.0) {
            return Err(AveragerError::NonFinite(format!("weight {weight}")));
        }
        let weight = if cfg.mode == AveragingMode::Aux {
            0.0
        } else {
            weight
        };
        let total: usize = tensors.iter().map(|t| t.len()).sum();
        if total == 0 {
            return Err(AveragerError::Schema("no elements to average".into()));
        }
        // Flatten (the round's snapshot of the tensors) and check for NaN/Inf in one pass: each
        // piece is checked right after it is copied, while it is still in cache. A round needs
        // about 4 model-sized buffers (this one, the one the previous round's repair server
        // still holds, what it receives as a reducer, the deltas it gets back): the pool keeps
        // that much for the next round instead of faulting in fresh pages every time.
        self.shared
            .pool
            .set_limit(4 * total * std::mem::size_of::<f32>());
        let mut flat = self.shared.pool.take_dirty(total);
        let mut at = 0;
        for (i, t) in tensors.iter().enumerate() {
            for piece in t.chunks(FLATTEN_PIECE) {
                let dst = &mut flat[at..at + piece.len()];
                dst.copy_from_slice(piece);
                if !dst.iter().all(|v| v.is_finite()) {
                    return Err(AveragerError::NonFinite(format!(
                        "tensor {i} holds NaN or infinity"
                    )));
                }
                at += piece.len();
            }
        }
        let sizes: Vec<usize> = tensors.iter().map(|t| t.len()).collect();
        let schema = schema_hash(&sizes, &cfg.codec.to_string());
        let grid = self.shared.grid_index.lock().map(|g| *g).unwrap_or(0);
        let group_key = format!("{}.averager.{schema:016x}.{grid}", cfg.prefix);
        let me = MemberInfo {
            peer_id: self.shared.node.peer_id().to_bytes(),
            mode: self.effective_mode().await,
            bandwidth: self.shared.bandwidth(),
            addrs: self
                .shared
                .node
                .listen_addrs()
                .await?
                .iter()
                .map(|a| a.to_string())
                .collect(),
        };

        let mm_start = Instant::now();
        let group = find_group(&self.shared, &group_key, me, deadline).await?;
        let matchmaking_time = mm_start.elapsed();

        let ar_start = Instant::now();
        let outcome = run_allreduce(&self.shared, &group, flat, f64::from(weight), deadline).await;
        let allreduce_time = ar_start.elapsed();
        self.shared.record_bandwidth(outcome.measured_bandwidth);
        if cfg.group_bits > 0 {
            if let Ok(mut g) = self.shared.grid_index.lock() {
                *g = (group.my_index as u32) % (1 << cfg.group_bits);
            }
        }
        if cfg.mode != AveragingMode::Aux {
            for (range, values) in &outcome.patches {
                write_flat(tensors, range.start, values);
            }
        }
        Ok(RoundReport {
            round_id: group.round_id,
            group: outcome.group,
            my_index: group.my_index,
            spans: outcome.spans,
            failed_peers: outcome.failed_peers,
            bytes_sent: outcome.bytes_sent,
            bytes_received: outcome.bytes_received,
            fast_lane_transfers: outcome.fast_lanes,
            matchmaking_time,
            allreduce_time,
        })
    }

    /// Stops the accept loops. Rounds in flight on other peers see this peer as failed.
    pub async fn shutdown(mut self) {
        self.shared.stop_repair_server();
        for t in self.tasks.drain(..) {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for Averager {
    fn drop(&mut self) {
        self.shared.stop_repair_server();
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// FNV-1a over the tensor sizes and the codec name: stable across platforms and versions.
pub(crate) fn schema_hash(sizes: &[usize], codec: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(&(sizes.len() as u64).to_le_bytes());
    for s in sizes {
        eat(&(*s as u64).to_le_bytes());
    }
    eat(codec.as_bytes());
    h
}

/// Serves one inbound protocol: reads each stream's first control message (bounded in time and
/// size, at most `MAX_INBOUND_HANDSHAKES` at once; extra streams are dropped, which refuses them)
/// and hands it to `handle` on its own task.
/// Writes `values` at flat offset `start` of the concatenation of `tensors`.
fn write_flat(tensors: &mut [&mut [f32]], start: usize, values: &[f32]) {
    let end = start + values.len();
    let mut offset = 0;
    for t in tensors.iter_mut() {
        let (lo, hi) = (offset, offset + t.len());
        offset = hi;
        if hi <= start {
            continue;
        }
        if lo >= end {
            break;
        }
        let (a, b) = (start.max(lo), end.min(hi));
        t[a - lo..b - lo].copy_from_slice(&values[a - start..b - start]);
    }
}

async fn serve_inbound<S, M, F, Fut>(
    shared: Arc<Shared>,
    mut incoming: impl futures::Stream<Item = (PeerId, S)> + Unpin,
    handle: F,
) where
    S: futures::AsyncRead + Unpin + Send + 'static,
    M: DeserializeOwned + Send + 'static,
    F: Fn(Arc<Shared>, PeerId, M, S) -> Fut + Copy + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let limit = Arc::new(Semaphore::new(MAX_INBOUND_HANDSHAKES));
    while let Some((peer, mut stream)) = incoming.next().await {
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let cfg = &shared.config;
            let first = timeout(
                cfg.request_timeout,
                read_control::<_, M>(&mut stream, cfg.max_frame_bytes),
            )
            .await;
            if let Ok(Ok(msg)) = first {
                handle(shared.clone(), peer, msg, stream).await;
            }
        });
    }
}

/// Routes a join request to the search in progress under its group key, or refuses it.
async fn on_join(shared: Arc<Shared>, peer: PeerId, msg: MatchMsg, mut stream: Stream) {
    let MatchMsg::Join {
        group_key,
        info,
        window_end,
    } = msg
    else {
        return;
    };
    if info.peer_id != peer.to_bytes() {
        tracing::debug!(%peer, "join request names another peer");
        return;
    }
    let route = shared
        .join_routes
        .lock()
        .ok()
        .and_then(|r| r.get(&group_key).cloned());
    let refusal = match route {
        Some(tx) => match tx.try_send(IncomingJoin {
            info,
            window_end,
            stream,
        }) {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Full(j) | mpsc::error::TrySendError::Closed(j)) => {
                stream = j.stream;
                RejectReason::Busy
            }
        },
        None => RejectReason::NotSearching,
    };
    let reply = MatchMsg::Rejected(refusal);
    let _ = timeout(
        shared.config.request_timeout,
        write_control(&mut stream, &reply),
    )
    .await;
}

/// Routes a sender's stream to the round its hello names (a re-delegation hello to the round's
/// repair queue), waiting a little for a round that this peer has not started yet.
async fn on_reduce(shared: Arc<Shared>, peer: PeerId, hello: ReduceMsg, mut stream: Lane) {
    let (round_id, repair) = match hello {
        ReduceMsg::Hello { round_id, .. } => (round_id, false),
        ReduceMsg::RepairHello { round_id, .. } => (round_id, true),
        _ => return,
    };
    let give_up = Instant::now() + shared.config.request_timeout;
    let route = loop {
        if let Some(tx) = shared.round_routes.lock().ok().and_then(|r| {
            r.get(&round_id).map(|route| {
                if repair {
                    route.repairs.clone()
                } else {
                    route.senders.clone()
                }
            })
        }) {
            break Some(tx);
        }
        if Instant::now() >= give_up {
            break None;
        }
        tokio::time::sleep(ROUND_ROUTE_WAIT).await;
    };
    if let Some(tx) = route {
        let incoming = IncomingSender {
            peer,
            hello,
            stream,
        };
        match tx.send(incoming).await {
            Ok(()) => return,
            // The round's reduction is over (the round lingers only to serve repairs): to this
            // sender, as good as a reducer that is gone.
            Err(mpsc::error::SendError(incoming)) => stream = incoming.stream,
        }
    }
    let reply = ReduceMsg::Excluded(UNKNOWN_ROUND.into());
    let _ = timeout(
        shared.config.request_timeout,
        write_control(&mut stream, &reply),
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::{schema_hash, write_flat};

    #[test]
    fn flat_writes_land_across_tensor_boundaries() {
        let mut a = vec![0.0f32; 3];
        let mut b = vec![0.0f32; 0];
        let mut c = vec![0.0f32; 4];
        {
            let mut ts: Vec<&mut [f32]> = vec![&mut a, &mut b, &mut c];
            write_flat(&mut ts, 2, &[1.0, 2.0, 3.0]);
            write_flat(&mut ts, 6, &[9.0]);
            write_flat(&mut ts, 0, &[]);
        }
        assert_eq!(a, vec![0.0, 0.0, 1.0]);
        assert_eq!(c, vec![2.0, 3.0, 0.0, 9.0]);
    }

    #[test]
    fn schema_hash_separates_sizes_order_and_codec() {
        let a = schema_hash(&[10, 20], "none");
        assert_eq!(a, schema_hash(&[10, 20], "none"));
        assert_ne!(a, schema_hash(&[20, 10], "none"));
        assert_ne!(a, schema_hash(&[30], "none"));
        assert_ne!(a, schema_hash(&[10, 20], "f16"));
    }
}
