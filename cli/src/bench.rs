//! `starling bench ...`: measurements that print one JSON object.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use clap::Subcommand;
use futures::stream::{self, StreamExt};
use rand::seq::SliceRandom;
use rand::Rng;
use serde::Serialize;
use starling_dht::now_ms;
use starling_node::{cluster::LocalCluster, Node, NodeConfig};

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Encode/decode throughput, wire size and error of every codec: one JSON object per codec.
    Compression {
        /// Elements (f32) of the random normal test tensor.
        #[arg(long, default_value_t = 10_000_000)]
        size: usize,
        /// Timed repetitions per codec (the best is reported).
        #[arg(long, default_value_t = 5)]
        iterations: usize,
    },
    /// Rounds of butterfly all-reduce between N peers on 127.0.0.1 (one group).
    Allreduce(crate::bench_allreduce::AllreduceArgs),
    /// One peer of `bench allreduce --procs` (started by it).
    #[command(hide = true)]
    AllreduceWorker(crate::bench_allreduce::WorkerArgs),
    /// N in-process peers gossip random vectors on a topology: exchanges per second and the
    /// consensus distance after every round.
    Gossip(crate::bench_gossip::GossipArgs),
    /// One-way throughput between two peers on 127.0.0.1: fast lane against libp2p stream.
    Lane(crate::bench_lane::LaneArgs),
    /// Where a collaborative global step's time goes (waiting, averaging, optimizer) for a
    /// synthetic model, beside plain all-reduce rounds of the same size (in-process peers).
    Training(crate::bench_training::TrainingArgs),
    /// Local collectives across N devices of this process (cpu threads or nccl GPUs): algorithm
    /// and bus bandwidth, and (cpu) this machine's memcpy bandwidth.
    Local(crate::bench_local::LocalArgs),
    /// Samples per second and latency of an expert server under many clients (in-process peers).
    Experts(crate::bench_experts::ExpertsBenchArgs),
    /// Store and read records across N in-process peers on 127.0.0.1.
    Dht {
        /// Number of peers.
        #[arg(long, default_value_t = 64)]
        peers: usize,
        /// Number of records (default: one per peer).
        #[arg(long)]
        records: Option<usize>,
        /// Fraction of peers killed half way through the run (0 to 0.9).
        #[arg(long, default_value_t = 0.0)]
        churn: f64,
        /// Operations in flight at once.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
    },
}

#[derive(Serialize, Default)]
struct LatencyStats {
    ops: usize,
    success_rate: f64,
    median_ms: f64,
    p99_ms: f64,
}

/// The `p` quantile (0..=1, nearest rank) of `sorted` values; 0 when there are none.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        0.0
    } else {
        sorted[((sorted.len() - 1) as f64 * p).round() as usize]
    }
}

impl LatencyStats {
    fn from(results: &[(bool, Duration)]) -> Self {
        let mut ms: Vec<f64> = results.iter().map(|(_, d)| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let pct = |p| percentile(&ms, p);
        LatencyStats {
            ops: results.len(),
            success_rate: if results.is_empty() {
                0.0
            } else {
                results.iter().filter(|(ok, _)| *ok).count() as f64 / results.len() as f64
            },
            median_ms: pct(0.5),
            p99_ms: pct(0.99),
        }
    }
}

#[derive(Serialize)]
struct DhtBench {
    bench: &'static str,
    peers: usize,
    records: usize,
    churn: f64,
    killed: usize,
    startup_s: f64,
    store: LatencyStats,
    get: LatencyStats,
    /// Stores and gets issued after the churn (by surviving peers); gets cover every record.
    store_after_churn: Option<LatencyStats>,
    get_after_churn: Option<LatencyStats>,
}

async fn timed_stores(
    nodes: &[Node],
    keys: &[String],
    concurrency: usize,
) -> Vec<(bool, Duration)> {
    stream::iter(keys.iter().cloned())
        .map(|key| {
            let node = nodes[rand::thread_rng().gen_range(0..nodes.len())].clone();
            async move {
                let t = Instant::now();
                let ok = node
                    .store(&key, "v", &key, now_ms() + 600_000)
                    .await
                    .is_ok();
                (ok, t.elapsed())
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await
}

async fn timed_gets(nodes: &[Node], keys: &[String], concurrency: usize) -> Vec<(bool, Duration)> {
    stream::iter(keys.iter().cloned())
        .map(|key| {
            let node = nodes[rand::thread_rng().gen_range(0..nodes.len())].clone();
            async move {
                let t = Instant::now();
                let ok = match node.get::<String>(&key).await {
                    Ok(v) => v.iter().any(|(_, value, _)| *value == key),
                    Err(_) => false,
                };
                (ok, t.elapsed())
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await
}

async fn bench_dht(
    peers: usize,
    records: usize,
    churn: f64,
    concurrency: usize,
) -> Result<DhtBench> {
    ensure!(peers >= 2, "--peers must be at least 2");
    ensure!(
        (0.0..=0.9).contains(&churn),
        "--churn must be between 0 and 0.9"
    );
    let t = Instant::now();
    let cluster = LocalCluster::start(peers, NodeConfig::default()).await?;
    let startup_s = t.elapsed().as_secs_f64();
    let run_id: u64 = rand::random();
    let keys: Vec<String> = (0..records)
        .map(|i| format!("bench.{run_id:x}.{i}"))
        .collect();
    let (first, second) = if churn > 0.0 {
        keys.split_at(records / 2)
    } else {
        (&keys[..], &[][..])
    };

    let store = timed_stores(&cluster.nodes, first, concurrency).await;
    let get = timed_gets(&cluster.nodes, first, concurrency).await;
    let mut result = DhtBench {
        bench: "dht",
        peers,
        records,
        churn,
        killed: 0,
        startup_s,
        store: LatencyStats::from(&store),
        get: LatencyStats::from(&get),
        store_after_churn: None,
        get_after_churn: None,
    };
    let mut nodes = cluster.nodes;
    if churn > 0.0 {
        let kill = ((peers as f64) * churn).round() as usize;
        nodes.shuffle(&mut rand::thread_rng());
        let victims: Vec<Node> = nodes.drain(..kill.min(peers - 1)).collect();
        futures::future::join_all(victims.iter().map(|n| n.shutdown())).await;
        result.killed = victims.len();
        let store2 = timed_stores(&nodes, second, concurrency).await;
        let get2 = timed_gets(&nodes, &keys, concurrency).await;
        result.store_after_churn = Some(LatencyStats::from(&store2));
        result.get_after_churn = Some(LatencyStats::from(&get2));
    }
    futures::future::join_all(nodes.iter().map(|n| n.shutdown())).await;
    Ok(result)
}

pub async fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Compression { size, iterations } => {
            ensure!(
                size >= 1 && iterations >= 1,
                "--size and --iterations must be at least 1"
            );
            for report in starling_compression::bench::run_benchmark(size, iterations) {
                println!("{}", serde_json::to_string(&report)?);
            }
        }
        BenchCommand::Allreduce(args) => crate::bench_allreduce::run(args).await?,
        BenchCommand::Experts(args) => crate::bench_experts::run(args).await?,
        BenchCommand::Lane(args) => crate::bench_lane::run(args).await?,
        BenchCommand::Gossip(args) => crate::bench_gossip::run(args).await?,
        BenchCommand::Training(args) => crate::bench_training::run(args).await?,
        BenchCommand::Local(args) => crate::bench_local::run(args)?,
        BenchCommand::AllreduceWorker(args) => crate::bench_allreduce::worker(args).await?,
        BenchCommand::Dht {
            peers,
            records,
            churn,
            concurrency,
        } => {
            let r = bench_dht(peers, records.unwrap_or(peers), churn, concurrency).await?;
            println!("{}", serde_json::to_string(&r)?);
        }
    }
    Ok(())
}
