//! The measurements behind `starling bench ...`, each printing JSON on stdout, and the
//! in-process swarms they run ([`harness`], shared with the integration tests).
//!
//! Each bench declares its flags (a clap `Args`) beside the code that reads them, and
//! [`BenchCommand`] gathers them; the binary nests it under `starling bench` and calls [`run`].
//! Multi-process benches start their workers through the same binary ([`Workers`]).
//!
//! - [`allreduce`]: rounds of butterfly all-reduce, beside [`reference`](mod@reference), a plain-TCP butterfly
//!   over the same sockets' kind, in one process or one process per peer (optionally in network
//!   namespaces).
//! - [`training`]: where a collaborative global step's time goes, and (with simulated compute)
//!   how close a swarm of N processes comes to N times one peer's samples per second.
//! - [`gossip`], [`lane`], [`local`], [`experts`], [`dht`]: gossip rounds, fast lane against
//!   libp2p streams, local collectives, an expert server under load, DHT latencies at scale.
//!
//! ```
//! // The quantile helper every bench reports latencies with (nearest rank).
//! assert_eq!(starling_bench::percentile(&[1.0, 2.0, 3.0, 4.0], 0.5), 3.0);
//! ```

#![warn(missing_docs)]

pub mod allreduce;
pub mod dht;
pub mod experts;
pub mod gossip;
pub mod harness;
pub mod lane;
pub mod local;
pub mod reference;
pub mod training;

use anyhow::{ensure, Result};
use clap::{Args, Subcommand};
use starling_node::{Multiaddr, NodeConfig};

/// Every bench, as `starling bench` names them.
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
    Allreduce(crate::allreduce::AllreduceArgs),
    /// One peer of `bench allreduce --procs` (started by it).
    #[command(hide = true)]
    AllreduceWorker(crate::allreduce::WorkerArgs),
    /// N in-process peers gossip random vectors on a topology: exchanges per second and the
    /// consensus distance after every round.
    Gossip(crate::gossip::GossipArgs),
    /// One-way throughput between two peers on 127.0.0.1: fast lane against libp2p stream.
    Lane(crate::lane::LaneArgs),
    /// Where a collaborative global step's time goes (waiting, averaging, optimizer) for a
    /// synthetic model, beside plain all-reduce rounds of the same size (in-process peers).
    Training(crate::training::TrainingArgs),
    /// One peer of `bench training --sample-ms` (started by it).
    #[command(hide = true)]
    TrainingWorker(crate::training::simulated::SimWorkerArgs),
    /// Local collectives across N devices of this process (cpu threads or nccl GPUs): algorithm
    /// and bus bandwidth, and (cpu) this machine's memcpy bandwidth.
    Local(crate::local::LocalArgs),
    /// Samples per second and latency of an expert server under many clients (in-process peers).
    Experts(crate::experts::ExpertsBenchArgs),
    /// Store and read records across N peers (in this process, or spread over K processes)
    /// on 127.0.0.1: sequential and concurrent latencies, after killing a fraction, memory.
    Dht(crate::dht::DhtArgs),
    /// One process of `bench dht --procs` (started by it).
    #[command(hide = true)]
    DhtWorker(crate::dht::DhtWorkerArgs),
}

/// Reachability options of long-running nodes (`node`, benchmark workers).
#[derive(Args, Clone, Debug)]
pub struct NatArgs {
    /// Let autonat ask, and answer, peers at private IP addresses (10/8, 172.16/12,
    /// 192.168/16): for swarms whose shared network is itself private (a campus, a VPC, a test
    /// network). Leave off on the internet.
    #[arg(long)]
    autonat_private_ips: bool,
    /// An address this node is known to be reachable at (a public IP, a forwarded port),
    /// announced without waiting for autonat. A relay needs one before it accepts
    /// reservations. Repeatable.
    #[arg(long, value_name = "MULTIADDR")]
    external: Vec<Multiaddr>,
}

impl NatArgs {
    /// Applies these options to `cfg`.
    pub fn apply(&self, cfg: &mut NodeConfig) {
        cfg.nat = starling_node::NatConfig {
            private_ips: self.autonat_private_ips,
            ..cfg.nat.clone()
        };
        cfg.external_addrs.extend(self.external.iter().cloned());
    }
}

/// Where a bench worker joins: the options [`Workers::command`] passes it.
#[derive(clap::Args, Debug)]
pub struct WorkerPlace {
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
pub struct Workers {
    /// The bootstrap node the workers join through.
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
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        0.0
    } else {
        sorted[((sorted.len() - 1) as f64 * p).round() as usize]
    }
}

/// Runs one bench, printing its JSON.
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
        BenchCommand::Allreduce(args) => crate::allreduce::run(args).await?,
        BenchCommand::Experts(args) => crate::experts::run(args).await?,
        BenchCommand::Lane(args) => crate::lane::run(args).await?,
        BenchCommand::Gossip(args) => crate::gossip::run(args).await?,
        BenchCommand::Training(args) => crate::training::run(args).await?,
        BenchCommand::TrainingWorker(args) => crate::training::simulated::worker(args).await?,
        BenchCommand::Local(args) => crate::local::run(args)?,
        BenchCommand::AllreduceWorker(args) => crate::allreduce::worker(args).await?,
        BenchCommand::Dht(args) => crate::dht::run(args).await?,
        BenchCommand::DhtWorker(args) => crate::dht::worker(args).await?,
    }
    Ok(())
}
