//! `starling bench ...`: measurements that print one JSON object.

use anyhow::{ensure, Result};
use clap::Subcommand;

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
    /// One peer of `bench training --sample-ms` (started by it).
    #[command(hide = true)]
    TrainingWorker(crate::bench_training::simulated::SimWorkerArgs),
    /// Local collectives across N devices of this process (cpu threads or nccl GPUs): algorithm
    /// and bus bandwidth, and (cpu) this machine's memcpy bandwidth.
    Local(crate::bench_local::LocalArgs),
    /// Samples per second and latency of an expert server under many clients (in-process peers).
    Experts(crate::bench_experts::ExpertsBenchArgs),
    /// Store and read records across N peers (in this process, or spread over K processes)
    /// on 127.0.0.1: sequential and concurrent latencies, after killing a fraction, memory.
    Dht(crate::bench_dht::DhtArgs),
    /// One process of `bench dht --procs` (started by it).
    #[command(hide = true)]
    DhtWorker(crate::bench_dht::DhtWorkerArgs),
}

/// The `p` quantile (0..=1, nearest rank) of `sorted` values; 0 when there are none.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        0.0
    } else {
        sorted[((sorted.len() - 1) as f64 * p).round() as usize]
    }
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
        BenchCommand::TrainingWorker(args) => {
            crate::bench_training::simulated::worker(args).await?
        }
        BenchCommand::Local(args) => crate::bench_local::run(args)?,
        BenchCommand::AllreduceWorker(args) => crate::bench_allreduce::worker(args).await?,
        BenchCommand::Dht(args) => crate::bench_dht::run(args).await?,
        BenchCommand::DhtWorker(args) => crate::bench_dht::worker(args).await?,
    }
    Ok(())
}
