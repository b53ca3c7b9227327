//! `starling bench dht`: what a user of the DHT sees, on N peers spread over K processes of
//! this machine (127.0.0.1).
//!
//! Phases, each over records stored by random peers and read by other random peers:
//! sequential (one operation at a time: the latency of a lone lookup) and concurrent
//! (`--concurrency` in flight), for `store`, `get` (latest: the whole lookup) and `get_first`
//! (the first live value). Then, with `--kill F`, a fraction of the peers (spread over the
//! processes) stops and the survivors read every record again. Reported per operation: count,
//! success rate, p50/p90/p99 milliseconds; and the resident memory per peer.
//!
//! With `--procs K` the first process hosts its share of the peers and starts K-1 copies of
//! itself (`bench dht-worker`, hidden) that host the rest, bootstrapped from the first
//! process's first peer. The coordinator sends each operation to the process that hosts the
//! chosen peer as a JSON line on its stdin and reads the answer from its stdout.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use futures::{stream, StreamExt};
use rand::seq::SliceRandom;
use rand::Rng;
use serde::{Deserialize, Serialize};
use starling_dht::now_ms;
use starling_node::{ConnectionLimits, Multiaddr, Node, NodeConfig};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot, Mutex};

mod limits;
mod report;
mod worker;
use limits::{open_files_limit, peer_connections};
use report::{LatencyStats, PhaseStats, Report, RoutingStats};
pub use worker::{worker, DhtWorkerArgs};

/// Arguments of `starling bench dht`.
#[derive(Args, Debug, Clone)]
pub struct DhtArgs {
    /// Number of peers.
    #[arg(long, default_value_t = 64)]
    peers: usize,
    /// Processes to spread the peers over (this one and K-1 workers).
    #[arg(long, default_value_t = 1)]
    procs: usize,
    /// Records stored in the concurrent phase (default: one per peer).
    #[arg(long)]
    records: Option<usize>,
    /// Records stored in the sequential phase (one operation at a time).
    #[arg(long, default_value_t = 50)]
    sequential: usize,
    /// Operations in flight at once in the concurrent phase.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Fraction of peers stopped after the first phases (0 to 0.9); the survivors then read
    /// every record again.
    #[arg(long, alias = "churn", default_value_t = 0.0)]
    kill: f64,
    /// Seconds a connection may stay idle before it closes (the node's
    /// `idle_connection_timeout`; default: the node default, 120).
    #[arg(long)]
    idle_timeout: Option<u64>,
    /// Seconds between Kademlia routing-table refreshes of each peer (the node's
    /// `routing_refresh_interval`; 0: never). Default: the node's 300 s up to 128 peers,
    /// stretched by peers / 128 above (2400 s at 1024 peers): every peer of a simulated swarm
    /// refreshes on this machine's cores, and a thousand peers at 300 s start about three
    /// refreshes a second, each a few hundred requests.
    #[arg(long)]
    refresh: Option<u64>,
    /// Connections each peer keeps before its connection manager prunes (its high-water mark;
    /// it prunes to half of it). Default: the node's (128), lowered where the peers of one
    /// process would not fit its open-file limit.
    #[arg(long)]
    max_connections: Option<usize>,
    /// Seconds to let the started swarm sit idle while its CPU time is measured
    /// (`idle_cpu_ms_per_s_per_peer` in the output; 0: skip).
    #[arg(long, default_value_t = 10)]
    settle: u64,
}

/// One operation, sent to the process hosting `peer`.
#[derive(Serialize, Deserialize, Debug, Clone)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Op {
    Store {
        id: u64,
        peer: usize,
        key: String,
    },
    Get {
        id: u64,
        peer: usize,
        key: String,
    },
    GetFirst {
        id: u64,
        peer: usize,
        key: String,
    },
    /// Stop these local peers.
    Kill {
        id: u64,
        peers: Vec<usize>,
    },
    /// Report resident memory.
    Rss {
        id: u64,
    },
}

impl Op {
    fn id(&self) -> u64 {
        match self {
            Op::Store { id, .. }
            | Op::Get { id, .. }
            | Op::GetFirst { id, .. }
            | Op::Kill { id, .. }
            | Op::Rss { id } => *id,
        }
    }
}

/// A worker's answer.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct Answer {
    id: u64,
    ok: bool,
    ms: f64,
    /// For `Rss`: resident kilobytes.
    #[serde(default)]
    rss_kb: u64,
    /// For `Rss`: connections of its live peers, summed.
    #[serde(default)]
    connections: u64,
    /// For `Rss`: the routing-table size of each live peer.
    #[serde(default)]
    routing: Vec<usize>,
}

/// The first line a worker prints: its peers are up.
#[derive(Serialize, Deserialize)]
struct Ready {
    ready: bool,
    /// Resident kilobytes before its peers started.
    base_rss_kb: u64,
}

/// CPU time (user + system) of process `pid` so far, in clock ticks (100 per second).
fn cpu_ticks(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // The command name may hold spaces: fields are counted after its closing parenthesis.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return 0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 here.
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(11) + field(12)
}

/// Resident set size of this process, KiB (0 where /proc is not readable).
fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Runs one store / get / get-first on a local peer; (success, milliseconds).
async fn run_local(node: &Node, op: &Op) -> (bool, f64) {
    let t = Instant::now();
    let found =
        |r: Result<Vec<(String, String, starling_dht::DhtTime)>, starling_node::NodeError>,
         key: &str| match r {
            Ok(v) if v.iter().any(|(_, value, _)| value == key) => true,
            Ok(v) => {
                tracing::debug!(key, values = v.len(), "read did not find the record");
                false
            }
            Err(e) => {
                tracing::debug!(key, error = %e, "read failed");
                false
            }
        };
    let ok = match op {
        Op::Store { key, .. } => match node.store(key, "v", key, now_ms() + 600_000).await {
            Ok(_) => true,
            Err(e) => {
                let st = node.status().await.ok();
                tracing::debug!(key, error = %e, routing = st.as_ref().map(|s| s.routing_table), connected = st.as_ref().map(|s| s.connected_peers), "store failed");
                false
            }
        },
        Op::Get { key, .. } => found(node.get::<String>(key).await, key),
        Op::GetFirst { key, .. } => found(node.get_first::<String>(key).await, key),
        Op::Kill { .. } | Op::Rss { .. } => true,
    };
    (ok, t.elapsed().as_secs_f64() * 1e3)
}

/// Routing-table sizes of the live `nodes` (0 for one that does not answer).
async fn routing_of(nodes: &[Option<Node>]) -> Vec<usize> {
    futures::future::join_all(
        nodes
            .iter()
            .flatten()
            .map(|n| async move { n.status().await.map_or(0, |s| s.routing_table) }),
    )
    .await
}

/// Open connections of the live `nodes`, summed.
async fn connections_of(nodes: &[Option<Node>]) -> u64 {
    let counts = futures::future::join_all(
        nodes
            .iter()
            .flatten()
            .map(|n| async move { n.connected_peers().await.map_or(0, |c| c.len() as u64) }),
    )
    .await;
    counts.into_iter().sum()
}

/// Peers of one process joining at once.
const JOINS_IN_FLIGHT: usize = 16;

/// Starts `n` peers, each bootstrapped from two of `boots` in turn (or, with none, all from the
/// first of them), each as `Node::start` does for a user: dial the bootstrap peers, one
/// Kademlia bootstrap. Spreading the joins keeps any one bootstrap peer from answering a
/// hundred newcomers at once (with one per worker, 12 of 1024 peers here found nobody else).
async fn start_peers(n: usize, boots: Vec<Multiaddr>, peer: PeerSettings) -> Result<Vec<Node>> {
    let template = NodeConfig {
        listen: vec!["/ip4/127.0.0.1/tcp/0".parse()?],
        idle_connection_timeout: peer.idle,
        routing_refresh_interval: peer.refresh,
        connections: peer.connections,
        // A thousand peers joining on two cores make handshakes slow: keep trying longer than
        // a user's node would (0.5 s, doubling: about a minute in all).
        bootstrap_attempts: 8,
        ..NodeConfig::default()
    };
    let mut nodes = Vec::with_capacity(n);
    let boots = if boots.is_empty() {
        let first = Node::start(template.clone()).await?;
        let addr = first
            .listen_addrs()
            .await?
            .into_iter()
            .next()
            .context("first peer has no address")?;
        nodes.push(first);
        vec![addr]
    } else {
        boots
    };
    // At most JOINS_IN_FLIGHT joins at a time, so that one bootstrap peer is not asked by a
    // thousand at once; a new one starts as soon as any ends (waves of 16 waited for each
    // wave's slowest Kademlia bootstrap: 1409 s for 1024 peers here).
    let remaining = n - nodes.len();
    let mut joins = futures::stream::iter(0..remaining)
        .map(|i| {
            let mut cfg = template
                .clone()
                .bootstrap_from(boots[i % boots.len()].clone());
            if boots.len() > 1 {
                cfg = cfg.bootstrap_from(boots[(i + 1) % boots.len()].clone());
            }
            Node::start(cfg)
        })
        .buffer_unordered(JOINS_IN_FLIGHT);
    while let Some(node) = joins.next().await {
        nodes.push(node?);
    }
    Ok(nodes)
}

/// Peers of a simulated swarm whose routing-table refreshes run at a node's own interval; above
/// it the interval stretches in proportion (see [`simulated_refresh`]).
const REFRESH_AT_NODE_INTERVAL: usize = 128;

/// The default refresh interval of each of `peers` simulated peers: a node's `interval` up to
/// [`REFRESH_AT_NODE_INTERVAL`] peers, stretched by `peers / 128` above, so that the swarm starts
/// no more refreshes a second than 128 real peers would. Each refresh is a lookup per routing
/// bucket (a few hundred requests, many over new connections): on real hosts every peer pays
/// for its own on its own cores, here a thousand peers pay on two, and at a node's 300 s their
/// refreshes alone keep both cores busy (measured: DHT reads slowed from 0.3 s to 19 s each).
fn simulated_refresh(interval: Option<Duration>, peers: usize) -> Option<Duration> {
    let stretch = u32::try_from(peers.div_ceil(REFRESH_AT_NODE_INTERVAL).max(1)).ok()?;
    interval.map(|i| i * stretch)
}

/// What the bench sets on every peer's [`NodeConfig`], in every process.
#[derive(Debug, Clone, Copy)]
struct PeerSettings {
    idle: Duration,
    refresh: Option<Duration>,
    connections: ConnectionLimits,
}

impl PeerSettings {
    /// The `--refresh` form: seconds, 0 for never.
    fn refresh_s(&self) -> u64 {
        self.refresh.map_or(0, |r| r.as_secs())
    }

    /// The refresh interval a `--refresh` of `s` seconds asks for (0: never).
    fn refresh_from_s(s: u64) -> Option<Duration> {
        (s > 0).then(|| Duration::from_secs(s))
    }
}

/// A worker process, from the coordinator's side.
struct Worker {
    stdin: Mutex<tokio::process::ChildStdin>,
    waiting: Arc<Mutex<HashMap<u64, oneshot::Sender<Answer>>>>,
    _child: tokio::process::Child,
}

impl Worker {
    /// Starts a worker hosting `peers` peers; with its resident KiB before they started.
    async fn spawn(peers: usize, boots: &[Multiaddr], peer: PeerSettings) -> Result<(Worker, u64)> {
        let exe = std::env::current_exe()?;
        let mut child = tokio::process::Command::new(exe)
            .args(["bench", "dht-worker", "--peers"])
            .arg(peers.to_string())
            .args(
                boots
                    .iter()
                    .flat_map(|b| ["--bootstrap".to_string(), b.to_string()]),
            )
            .arg("--idle-timeout")
            .arg(peer.idle.as_secs().to_string())
            .arg("--refresh")
            .arg(peer.refresh_s().to_string())
            .arg("--high-water")
            .arg(peer.connections.high_water.to_string())
            .arg("--low-water")
            .arg(peer.connections.low_water.to_string())
            .arg("--max-established")
            .arg(peer.connections.max_established.unwrap_or(0).to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting a dht worker")?;
        let stdin = child.stdin.take().context("worker stdin")?;
        let mut lines = BufReader::new(child.stdout.take().context("worker stdout")?).lines();
        let first = tokio::time::timeout(Duration::from_secs(600), lines.next_line())
            .await
            .context("worker did not start within 600 s")??
            .context("worker exited before it was ready")?;
        let ready: Ready = serde_json::from_str(&first).context("worker's ready line")?;
        ensure!(ready.ready, "worker not ready");
        let waiting: Arc<Mutex<HashMap<u64, oneshot::Sender<Answer>>>> = Arc::default();
        let w = waiting.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                match serde_json::from_str::<Answer>(&line) {
                    Ok(a) => {
                        if let Some(tx) = w.lock().await.remove(&a.id) {
                            let _ = tx.send(a);
                        }
                    }
                    Err(e) => tracing::warn!("bad worker line {line:?}: {e}"),
                }
            }
            // The worker is gone: whoever still waits gets a failure.
            w.lock().await.clear();
        });
        Ok((
            Worker {
                stdin: Mutex::new(stdin),
                waiting,
                _child: child,
            },
            ready.base_rss_kb,
        ))
    }

    async fn call(&self, op: &Op) -> Result<Answer> {
        let (tx, rx) = oneshot::channel();
        self.waiting.lock().await.insert(op.id(), tx);
        let mut line = serde_json::to_string(op)?;
        line.push('\n');
        self.stdin.lock().await.write_all(line.as_bytes()).await?;
        tokio::time::timeout(Duration::from_secs(120), rx)
            .await
            .context("worker did not answer within 120 s")?
            .context("worker exited")
    }
}

/// The swarm: local peers (process 0) and workers hosting the rest.
struct Swarm {
    local: Vec<Option<Node>>,
    workers: Vec<(Worker, usize)>,
    next_id: std::sync::atomic::AtomicU64,
}

impl Swarm {
    fn peers(&self) -> usize {
        self.local.len() + self.workers.iter().map(|(_, n)| n).sum::<usize>()
    }

    /// (process, local index) of global peer `i`.
    fn locate(&self, mut i: usize) -> (usize, usize) {
        if i < self.local.len() {
            return (0, i);
        }
        i -= self.local.len();
        for (w, (_, n)) in self.workers.iter().enumerate() {
            if i < *n {
                return (w + 1, i);
            }
            i -= n;
        }
        (0, 0)
    }

    fn id(&self) -> u64 {
        self.next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Runs a store / get / get-first for `key` on global peer `peer`.
    async fn run(&self, kind: &str, peer: usize, key: &str) -> (bool, f64) {
        let (proc, local) = self.locate(peer);
        let id = self.id();
        let key = key.to_string();
        let op = match kind {
            "store" => Op::Store {
                id,
                peer: local,
                key,
            },
            "get" => Op::Get {
                id,
                peer: local,
                key,
            },
            _ => Op::GetFirst {
                id,
                peer: local,
                key,
            },
        };
        if proc == 0 {
            return match &self.local[local] {
                Some(node) => run_local(node, &op).await,
                None => (false, 0.0),
            };
        }
        match self.workers[proc - 1].0.call(&op).await {
            Ok(a) => (a.ok, a.ms),
            Err(e) => {
                tracing::warn!("worker {proc}: {e:#}");
                (false, 0.0)
            }
        }
    }

    /// Total resident KiB of every process, connections of every live peer, and every live
    /// peer's routing-table size.
    async fn survey(&self) -> (u64, u64, Vec<usize>) {
        let mut total = rss_kb();
        let mut connections = connections_of(&self.local).await;
        let mut routing = routing_of(&self.local).await;
        for (w, _) in &self.workers {
            if let Ok(a) = w.call(&Op::Rss { id: self.id() }).await {
                total += a.rss_kb;
                connections += a.connections;
                routing.extend(a.routing);
            }
        }
        (total, connections, routing)
    }
}

/// `ops` of `kind` (peer, key) with `in_flight` at once.
async fn timed(
    swarm: &Swarm,
    kind: &str,
    ops: &[(usize, String)],
    in_flight: usize,
) -> Vec<(bool, f64)> {
    stream::iter(ops.iter())
        .map(|(peer, key)| swarm.run(kind, *peer, key))
        .buffer_unordered(in_flight.max(1))
        .collect()
        .await
}

/// Stores `keys` from random live peers, then reads each (latest, then first) from another
/// random live peer.
async fn phase(swarm: &Swarm, live: &[usize], keys: &[String], in_flight: usize) -> PhaseStats {
    let mut rng = rand::thread_rng();
    let stores: Vec<(usize, String)> = keys
        .iter()
        .map(|k| (live[rng.gen_range(0..live.len())], k.clone()))
        .collect();
    let started = Instant::now();
    let store = timed(swarm, "store", &stores, in_flight).await;
    eprintln!(
        "{} records, {in_flight} in flight: stored in {:.1} s",
        keys.len(),
        started.elapsed().as_secs_f64()
    );
    PhaseStats {
        store: LatencyStats::from(&store),
        ..reads(swarm, live, keys, in_flight).await
    }
}

/// Reads every key (latest, then first) from random live peers.
async fn reads(swarm: &Swarm, live: &[usize], keys: &[String], in_flight: usize) -> PhaseStats {
    let mut rng = rand::thread_rng();
    let mut pick = || live[rng.gen_range(0..live.len())];
    let gets: Vec<(usize, String)> = keys.iter().map(|k| (pick(), k.clone())).collect();
    let firsts: Vec<(usize, String)> = keys.iter().map(|k| (pick(), k.clone())).collect();
    let started = Instant::now();
    let get = timed(swarm, "get", &gets, in_flight).await;
    let get_first = timed(swarm, "get_first", &firsts, in_flight).await;
    eprintln!(
        "{} records, {in_flight} in flight: read in {:.1} s",
        keys.len(),
        started.elapsed().as_secs_f64()
    );
    PhaseStats {
        records: keys.len(),
        in_flight,
        store: LatencyStats::default(),
        get: LatencyStats::from(&get),
        get_first: LatencyStats::from(&get_first),
    }
}

/// `starling bench dht`.
pub async fn run(args: DhtArgs) -> Result<()> {
    ensure!(args.peers >= 2, "--peers must be at least 2");
    ensure!(
        args.procs >= 1 && args.procs <= args.peers,
        "--procs must be between 1 and --peers"
    );
    ensure!(
        (0.0..=0.9).contains(&args.kill),
        "--kill must be between 0 and 0.9"
    );
    let share = args.peers / args.procs;
    let connections = peer_connections(
        open_files_limit(),
        args.peers,
        args.peers - share * (args.procs - 1),
        args.max_connections,
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    let base_rss = rss_kb();
    let started = Instant::now();
    let first_share = args.peers - share * (args.procs - 1);
    let defaults = NodeConfig::default();
    let peer = PeerSettings {
        idle: args
            .idle_timeout
            .map(Duration::from_secs)
            .unwrap_or(defaults.idle_connection_timeout),
        refresh: args.refresh.map_or(
            simulated_refresh(defaults.routing_refresh_interval, args.peers),
            PeerSettings::refresh_from_s,
        ),
        connections,
    };
    let local = start_peers(first_share, Vec::new(), peer).await?;
    // Workers' peers bootstrap from all of this process's peers in turn.
    let mut boots = Vec::new();
    for node in &local {
        boots.extend(node.listen_addrs().await?.into_iter().next());
    }
    // One worker at a time: joins are the expensive part (every new peer's handshakes and
    // Kademlia bootstrap), and a thousand at once on two cores time each other out.
    let mut workers = Vec::new();
    let mut base_rss_all = base_rss;
    for _ in 1..args.procs {
        let (w, base) = Worker::spawn(share, &boots, peer).await?;
        base_rss_all += base;
        workers.push((w, share));
    }
    let mut swarm = Swarm {
        local: local.into_iter().map(Some).collect(),
        workers,
        next_id: Default::default(),
    };
    let startup_s = started.elapsed().as_secs_f64();
    eprintln!(
        "{} peers up in {startup_s:.1} s over {} processes",
        swarm.peers(),
        args.procs
    );
    // What the swarm costs when nobody asks it anything: pings, identify, Kademlia upkeep.
    let pids: Vec<u32> = std::iter::once(std::process::id())
        .chain(swarm.workers.iter().filter_map(|(w, _)| w._child.id()))
        .collect();
    let ticks = || pids.iter().map(|p| cpu_ticks(*p)).sum::<u64>();
    let (t0, c0) = (Instant::now(), ticks());
    tokio::time::sleep(Duration::from_secs(args.settle)).await;
    let idle_cpu = if args.settle > 0 {
        (ticks() - c0) as f64 * 10.0 / t0.elapsed().as_secs_f64() / swarm.peers() as f64
    } else {
        0.0
    };
    let (_, idle_connections, routing) = swarm.survey().await;
    let idle_connections = idle_connections as f64 / swarm.peers() as f64;
    let routing_table = RoutingStats::from(routing);
    eprintln!(
        "idle: {idle_cpu:.3} ms of CPU per second per peer, {idle_connections:.1} connections per \
         peer; routing tables: min {}, p10 {}, median {}, {} isolated",
        routing_table.min, routing_table.p10, routing_table.p50, routing_table.isolated
    );
    let run_id: u64 = rand::random();
    let key = |phase: &str, i: usize| format!("bench.{run_id:x}.{phase}.{i}");
    let all: Vec<usize> = (0..swarm.peers()).collect();
    let seq_keys: Vec<String> = (0..args.sequential).map(|i| key("s", i)).collect();
    let sequential = phase(&swarm, &all, &seq_keys, 1).await;
    let conc_keys: Vec<String> = (0..args.records.unwrap_or(args.peers))
        .map(|i| key("c", i))
        .collect();
    let concurrent = phase(&swarm, &all, &conc_keys, args.concurrency).await;
    let (rss_total, connections, _) = swarm.survey().await;
    let mut killed = 0;
    let mut after_kill = None;
    if args.kill > 0.0 {
        let mut order = all.clone();
        order.shuffle(&mut rand::thread_rng());
        let n = ((swarm.peers() as f64) * args.kill).round() as usize;
        let victims: Vec<usize> = order[..n.min(swarm.peers() - 1)].to_vec();
        let live: Vec<usize> = order[victims.len()..].to_vec();
        let mut per_proc: HashMap<usize, Vec<usize>> = HashMap::new();
        for &v in &victims {
            let (p, l) = swarm.locate(v);
            per_proc.entry(p).or_default().push(l);
        }
        for (p, locals) in per_proc {
            if p == 0 {
                for l in locals {
                    if let Some(node) = swarm.local[l].take() {
                        node.shutdown().await;
                    }
                }
            } else {
                let op = Op::Kill {
                    id: swarm.id(),
                    peers: locals,
                };
                swarm.workers[p - 1].0.call(&op).await?;
            }
        }
        killed = victims.len();
        let mut every: Vec<String> = seq_keys.clone();
        every.extend(conc_keys.iter().cloned());
        after_kill = Some(reads(&swarm, &live, &every, args.concurrency).await);
    }
    futures::future::join_all(swarm.local.iter().flatten().map(|n| n.shutdown())).await;
    let report = Report {
        bench: "dht",
        peers: args.peers,
        procs: args.procs,
        startup_s,
        idle_timeout_s: peer.idle.as_secs(),
        high_water: peer.connections.high_water,
        low_water: peer.connections.low_water,
        max_established: peer.connections.max_established,
        routing_refresh_s: peer.refresh.map(|r| r.as_secs()),
        sequential,
        concurrent,
        killed,
        after_kill,
        rss_total_mb: rss_total as f64 / 1024.0,
        rss_per_peer_kb: rss_total.saturating_sub(base_rss_all) as f64 / args.peers as f64,
        connections_per_peer: connections as f64 / args.peers as f64,
        idle_cpu_ms_per_s_per_peer: idle_cpu,
        idle_connections_per_peer: idle_connections,
        routing_table,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_simulated_swarm_refreshes_no_more_often_than_128_real_peers() {
        let node = Some(Duration::from_secs(300));
        assert_eq!(simulated_refresh(node, 64), node);
        assert_eq!(simulated_refresh(node, 128), node);
        assert_eq!(
            simulated_refresh(node, 1024),
            Some(Duration::from_secs(2400))
        );
        assert_eq!(simulated_refresh(None, 1024), None);
        // The swarm's refreshes per second stay at or under 128 peers' at the node interval.
        for peers in [129, 500, 1024, 4096] {
            let every = simulated_refresh(node, peers).unwrap().as_secs_f64();
            assert!(peers as f64 / every <= 128.0 / 300.0 + 1e-9, "{peers}");
        }
    }
}
