//! `starling`: train together (`train`, `demo`), run a node, bootstrap a private swarm, use the DHT, host experts, benchmark.

mod demo;
mod dht_cmd;
mod experts_cmd;
mod malloc;
mod node_cmd;
mod observe;
mod sched;
mod status_cmd;
mod train;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use starling_bench::NatArgs;
use starling_node::{Multiaddr, NodeConfig, SwarmKey};

#[derive(Parser)]
#[command(
    name = "starling",
    version,
    about = "Decentralized peer-to-peer training network"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a private swarm: writes a new 256-bit swarm key file.
    InitSwarm {
        /// Where to write the key (created with 0600 permissions; never overwritten).
        #[arg(long, default_value = "swarm.key")]
        out: PathBuf,
    },
    /// Run a node and print its status periodically until interrupted (Ctrl-C).
    Node(node_cmd::NodeArgs),
    /// Create a training run or join one, and train in it until its last epoch.
    Train(Box<train::TrainArgs>),
    /// Zero configuration: N peers on 127.0.0.1 train a digits classifier together, beside one
    /// peer alone.
    Demo(demo::DemoArgs),
    /// Read and write DHT records by joining the swarm briefly as a client.
    Dht {
        #[command(subcommand)]
        command: dht_cmd::DhtCommand,
    },
    /// Host mixture-of-experts layers, or list the live ones.
    Experts {
        #[command(subcommand)]
        command: experts_cmd::ExpertsCommand,
    },
    /// List the live swarm (every node's heartbeat) by joining briefly as a client.
    Status(status_cmd::StatusArgs),
    /// Benchmarks that print one JSON object.
    Bench {
        #[command(subcommand)]
        command: starling_bench::BenchCommand,
    },
}

/// Options shared by every command that joins a swarm.
#[derive(Args, Clone, Debug)]
pub struct JoinArgs {
    /// Swarm key file of a private swarm (see `starling init-swarm`).
    #[arg(long, value_name = "FILE")]
    swarm: Option<PathBuf>,
    /// Peer to join through, as a full multiaddr ending in `/p2p/<peer id>`. Repeatable.
    #[arg(long, value_name = "MULTIADDR")]
    bootstrap: Vec<Multiaddr>,
    /// Identity key file (created with 0600 permissions when absent). Default: a fresh identity.
    #[arg(long, value_name = "FILE")]
    identity: Option<PathBuf>,
    /// Timeout for each dial and DHT query, in seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
    /// TCP port of the fast lane (direct encrypted connections for bulk averaging data), on the
    /// same IPs as libp2p's listen addresses; open it in firewalls as well (peers that cannot
    /// reach it fall back to libp2p streams, at about half the speed). 0: chosen by the OS.
    #[arg(long, value_name = "PORT", default_value_t = 0)]
    fast_lane_port: u16,
    /// Run without the fast lane: every transfer uses libp2p streams.
    #[arg(long)]
    no_fast_lane: bool,
}

impl JoinArgs {
    fn config(&self) -> Result<NodeConfig> {
        let mut cfg = NodeConfig::default();
        if let Some(path) = &self.swarm {
            cfg.swarm_key = Some(SwarmKey::read(path)?);
        }
        if let Some(path) = &self.identity {
            cfg.identity_file = Some(path.clone());
        }
        cfg.bootstrap = self.bootstrap.clone();
        anyhow::ensure!(
            self.timeout.is_finite() && self.timeout > 0.0,
            "--timeout must be a positive number of seconds"
        );
        cfg.request_timeout = std::time::Duration::from_secs_f64(self.timeout);
        cfg.fast_lane = !self.no_fast_lane;
        cfg.fast_lane_port = self.fast_lane_port;
        Ok(cfg)
    }
}

/// Where a long-running peer listens (`node`, `train`).
#[derive(Args, Clone, Debug)]
pub struct ListenArgs {
    /// Address to listen on. Repeatable. Default: TCP (and QUIC in public swarms) on all
    /// interfaces with OS-chosen ports.
    #[arg(long, value_name = "MULTIADDR")]
    listen: Vec<Multiaddr>,
    /// Client mode: accept no inbound connections (behind NAT, or by choice).
    #[arg(long)]
    client: bool,
}

impl ListenArgs {
    /// Applies these options to `cfg`.
    pub fn apply(&self, cfg: &mut NodeConfig) {
        cfg.listen = self.listen.clone();
        cfg.client_mode = self.client;
    }
}

fn init_swarm(out: &std::path::Path) -> Result<()> {
    let key = SwarmKey::generate();
    key.write_new(out)
        .with_context(|| format!("writing the swarm key to {}", out.display()))?;
    println!(
        "Created private swarm key {} (fingerprint {}).",
        out.display(),
        key.fingerprint()
    );
    println!("Copy this file to every machine of the swarm over a trusted channel, then:");
    println!(
        "  first machine:  starling node --swarm {} --listen /ip4/0.0.0.0/tcp/4001 --fast-lane-port 4002",
        out.display()
    );
    println!("  other machines: starling node --swarm {} --bootstrap /ip4/<first machine's IP>/tcp/4001/p2p/<its peer id>", out.display());
    println!("Open both TCP ports (libp2p's and the fast lane's, printed at start) in firewalls.");
    println!("Peers without this key cannot connect.");
    Ok(())
}

/// Log filter when `RUST_LOG` is unset: warnings only, and not libp2p-kad's warning that a lone
/// first node has nobody to bootstrap from, nor yamux's that a peer which already left did not
/// take the close of its connection (every shutdown of many peers printed dozens).
const DEFAULT_LOG_FILTER: &str = "warn,libp2p_kad=error,yamux=error";

/// Raises this process's open-file limit (soft) to its hard limit. A node holds a socket per
/// connection and per fast lane: in a swarm of a thousand peers a busy node holds several
/// hundred, and many systems start processes with a soft limit of 1024, which would end in
/// "Too many open files" on accepts and dials. (Go programs, hivemind's daemon among them, do
/// the same at start.)
fn raise_open_file_limit() {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => tracing::debug!(limit, "open-file limit"),
        Err(e) => tracing::warn!("cannot raise the open-file limit: {e}"),
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER)),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    malloc::tune_for_tensors();
    raise_open_file_limit();
    if let Command::Train(args) = &cli.command {
        // Before any thread starts: they all inherit it.
        args.sched().apply_to_this_thread();
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::InitSwarm { out } => init_swarm(&out),
            Command::Node(args) => node_cmd::run(args).await,
            Command::Train(args) => train::run(*args).await,
            Command::Demo(args) => demo::run(args).await,
            Command::Dht { command } => dht_cmd::run(command).await,
            Command::Experts { command } => experts_cmd::run(command).await,
            Command::Status(args) => status_cmd::run(args).await,
            Command::Bench { command } => starling_bench::run(command).await,
        }
    });
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
