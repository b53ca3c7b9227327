//! `starling bench gossip`: N in-process peers on 127.0.0.1 gossip random vectors round by
//! round; prints one JSON object with the exchanges per second and the consensus distance after
//! every round.

use std::time::{Duration, Instant};

use crate::harness::GossipSwarm;
use anyhow::{ensure, Context, Result};
use clap::Args;
use serde::Serialize;
use starling_averager::gossip::{GossipConfig, Topology};
use starling_node::{cluster::LocalCluster, NodeConfig};

/// The flags of `starling bench gossip`.
#[derive(Args, Debug)]
pub struct GossipArgs {
    /// Number of peers.
    #[arg(long, default_value_t = 16)]
    peers: usize,
    /// ring, exponential, random-K or one-peer-exponential.
    #[arg(long, default_value = "one-peer-exponential")]
    topology: String,
    /// Rounds (every peer steps once per round).
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Elements (f32) per peer.
    #[arg(long, default_value_t = 100_000)]
    size: usize,
    /// Codec on the wire.
    #[arg(long, default_value = "none")]
    codec: String,
    /// Mixing weight (0 < alpha <= 1).
    #[arg(long, default_value_t = 1.0)]
    alpha: f64,
}

#[derive(Serialize)]
struct GossipBench {
    bench: &'static str,
    peers: usize,
    topology: String,
    codec: String,
    size: usize,
    rounds: usize,
    /// Exchanges averaged (each counted once, by its initiator) per second of gossip.
    exchanges_per_second: f64,
    exchanges: u64,
    /// Seconds of the timed rounds.
    seconds: f64,
    /// Consensus distance (mean squared distance to the weighted mean, per element) once the
    /// peers know each other, then after each round.
    consensus_distance: Vec<f64>,
    /// Relative drift of the weighted mean over the run (exact codec: float rounding only).
    mean_drift: f64,
    /// Bytes sent per peer and round, the mean.
    bytes_per_peer_round: f64,
}

/// Runs `starling bench gossip` and prints its JSON report.
pub async fn run(args: GossipArgs) -> Result<()> {
    ensure!(args.peers >= 2, "--peers must be at least 2");
    ensure!(
        args.size >= 1 && args.rounds >= 1,
        "--size and --rounds must be at least 1"
    );
    let topology: Topology = args.topology.parse().map_err(anyhow::Error::msg)?;
    let codec = args
        .codec
        .parse()
        .map_err(|e| anyhow::anyhow!("--codec: {e}"))?;
    let cfg = GossipConfig::new("bench-gossip")
        .topology(topology)
        .codec(codec)
        .alpha(args.alpha);
    let cluster = LocalCluster::start(args.peers, NodeConfig::default()).await?;
    let mut swarm = GossipSwarm::start(&cluster, &cfg, args.size, 1).await?;
    let start = swarm.consensus_of_vectors();
    // Warm-up: every peer declares itself, then reads all the others.
    for (i, r) in swarm.round().await {
        r.with_context(|| format!("peer {i}'s first round"))?;
    }
    ensure!(
        swarm.settle_membership(100).await,
        "the peers did not all see each other in the DHT"
    );
    let mut distances = vec![swarm.consensus().await.distance];
    let (mut exchanges, mut bytes) = (0u64, 0u64);
    let mut gossip_time = Duration::ZERO;
    for round in 0..args.rounds {
        let t = Instant::now();
        let reports = swarm.round().await;
        gossip_time += t.elapsed();
        for (i, r) in reports {
            let r = r.with_context(|| format!("peer {i}, round {round}"))?;
            exchanges += r.exchanges.iter().filter(|e| e.averaged()).count() as u64;
            bytes += r
                .exchanges
                .iter()
                .chain(&r.served)
                .map(|e| e.bytes_sent)
                .sum::<u64>();
        }
        distances.push(swarm.consensus().await.distance);
    }
    let end = swarm.consensus().await;
    swarm.shutdown().await;
    cluster.shutdown().await;
    let seconds = gossip_time.as_secs_f64();
    let out = GossipBench {
        bench: "gossip",
        peers: args.peers,
        topology: topology.to_string(),
        codec: args.codec,
        size: args.size,
        rounds: args.rounds,
        exchanges_per_second: exchanges as f64 / seconds.max(1e-9),
        exchanges,
        seconds,
        consensus_distance: distances,
        mean_drift: end.mean_error(&start),
        bytes_per_peer_round: bytes as f64 / (args.peers * args.rounds) as f64,
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}
