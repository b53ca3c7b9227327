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

/// Where a bench worker joins: the options [`Workers::command`] passes it.
#[derive(clap::Args, Debug)]
pub(crate) struct WorkerPlace {
    /// Where to join (the bench's bootstrap node).
    #[arg(long)]
    pub bootstrap: starling_node::Multiaddr,
    /// This worker's index (selects its data).
    #[arg(long)]
    pub index: usize,
    /// Address to listen on. Default: the node's (TCP and QUIC on all interfaces), as a
    /// `starling node` on another machine would.
    #[arg(long)]
    pub listen: Option<starling_node::Multiaddr>,
}

/// Where the worker processes of a multi-process bench start from: a bootstrap node in this
/// process (it takes no part in the bench) and, with network namespaces, one namespace per
/// worker (entered through `ip netns exec`, as root).
pub(crate) struct Workers {
    pub boot: starling_node::Node,
    boot_addr: starling_node::Multiaddr,
    netns: Vec<String>,
    exe: std::path::PathBuf,
}

impl Workers {
    /// Starts the bootstrap node: on 127.0.0.1 for workers on this host, on every interface
    /// (handing out a non-loopback address) when `netns` names one namespace per worker.
    pub async fn start(netns: &[String], workers: usize) -> Result<Self> {
        ensure!(
            netns.is_empty() || netns.len() == workers,
            "--netns must name one namespace per peer ({} names for {workers} peers)",
            netns.len()
        );
        let listen = if netns.is_empty() {
            "/ip4/127.0.0.1/tcp/0"
        } else {
            "/ip4/0.0.0.0/tcp/0"
        };
        let cfg = starling_node::NodeConfig::default().listen_on(listen.parse()?);
        let boot = starling_node::Node::start(cfg).await?;
        let boot_addr = reachable_addr(&boot, !netns.is_empty()).await?;
        Ok(Workers {
            boot,
            boot_addr,
            netns: netns.to_vec(),
            exe: std::env::current_exe()?,
        })
    }

    /// `starling bench SUBCOMMAND --bootstrap ADDR --index I` for worker `i`, in its namespace
    /// if any (listening with the node's defaults there, as a user's node would; on one host,
    /// on loopback only). The caller adds its own arguments and spawns it.
    pub fn command(&self, subcommand: &str, i: usize) -> tokio::process::Command {
        let mut cmd = match self.netns.get(i) {
            Some(ns) => {
                let mut c = tokio::process::Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.exe);
                c
            }
            None => tokio::process::Command::new(&self.exe),
        };
        cmd.args(["bench", subcommand, "--bootstrap"])
            .arg(self.boot_addr.to_string())
            .args(["--index", &i.to_string()]);
        if self.netns.is_empty() {
            cmd.args(["--listen", "/ip4/127.0.0.1/tcp/0"]);
        }
        cmd.kill_on_drop(true);
        cmd
    }
}

/// An address of `boot` that workers can dial: any, on one host; across namespaces a
/// non-loopback one (interfaces are reported one by one: this waits a little for one).
async fn reachable_addr(
    boot: &starling_node::Node,
    across_namespaces: bool,
) -> Result<starling_node::Multiaddr> {
    let wanted = |a: &starling_node::Multiaddr| {
        !across_namespaces || !a.to_string().starts_with("/ip4/127.")
    };
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let found = boot.listen_addrs().await?.into_iter().find(wanted);
        match found {
            Some(a) => return Ok(a),
            None if std::time::Instant::now() < give_up => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            None => anyhow::bail!("the bootstrap node has no address the workers can reach"),
        }
    }
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
