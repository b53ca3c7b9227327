//! `starling bench allreduce`: rounds of averaging between N peers on 127.0.0.1, in one process
//! or (with `--procs`) one process per peer.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::harness::{AveragingSwarm, WeightedMean};
use anyhow::{anyhow, bail, ensure, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use starling_averager::{Averager, AveragerConfig};
use starling_compression::{bench::relative_error, synthetic::normal};
use starling_node::{Node, NodeConfig};

use crate::reference::TcpButterfly;
use tokio::io::{AsyncBufReadExt, BufReader};

/// The flags of `starling bench allreduce`.
#[derive(Args, Debug, Clone)]
pub struct AllreduceArgs {
    /// Number of peers (one group of this size).
    #[arg(long, default_value_t = 4)]
    pub peers: usize,
    /// Elements (f32) per peer.
    #[arg(long, default_value_t = 1_000_000)]
    pub size: usize,
    /// Codec on the wire (none, f16, bf16, u8, blockwise8, ...).
    #[arg(long, default_value = "none")]
    pub codec: String,
    /// How reducers combine contributions (mean, median, `trimmed-mean[:F]`,
    /// `centered-clip[:iters=N][,tau=T][,reject=K]`). The exactness check (`rel_error`) is against the mean.
    #[arg(long, default_value = "mean")]
    pub aggregation: String,
    /// Check reducers: each peer recomputes one random block of another reducer's result
    /// after each round with this probability (`AveragerConfig::verify`; 0: off).
    #[arg(long, default_value_t = 0.0)]
    pub verify: f64,
    /// Measured rounds (one extra warm-up round runs first).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Run each peer in its own process.
    #[arg(long)]
    pub procs: bool,
    /// Largest chunk on the wire, in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub chunk_bytes: usize,
    /// Split spans equally instead of by measured bandwidth (for comparison).
    #[arg(long)]
    pub equal_spans: bool,
    /// Move data over libp2p streams only, not the fast lane (for comparison).
    #[arg(long)]
    pub no_fast_lane: bool,
    /// After the measured rounds, shut one peer's node down and run as many rounds again with
    /// the others (groups may then start with one peer fewer; the default 5 s matchmaking
    /// window): `after_kill` in the output has the same medians for those rounds. In-process
    /// only.
    #[arg(long, conflicts_with = "procs")]
    pub kill: bool,
    /// After Starling's rounds, the same peers run as many rounds of a plain-TCP butterfly
    /// (equal spans, same codec and chunks, connections kept open between rounds, no
    /// encryption): `reference` in the output, and `vs_reference` = Starling's median
    /// all-reduce time over the reference's.
    #[arg(long)]
    pub reference: bool,
    /// With `--procs`: run worker `i` in network namespace `i` of this comma-separated list
    /// (through `ip netns exec`, as root), listening on all interfaces as on separate machines.
    /// The bootstrap node runs in this process, which must be able to reach every namespace
    /// (run it inside the first one). See `scripts/bench_netns.sh`.
    #[arg(long, value_delimiter = ',', requires = "procs")]
    pub netns: Vec<String>,
    /// Pre-scheduled matchmaking, as training does it: each round's search starts
    /// (`Averager::prepare`) this many milliseconds before its step, the time a peer would
    /// still spend computing its last batches. `matchmaking` then reports what is left of the
    /// search when the step begins. 0 (the default) searches when the step begins.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub prepare_ms: u64,
    /// Simulated round trips between the peers, in milliseconds (`NodeConfig::simulated_rtt`:
    /// every TCP read, libp2p's and the fast lane's, is held back half of it; a simulation
    /// for benches, this kernel has no netem). 0: none.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub sim_rtt_ms: u64,
}

impl AllreduceArgs {
    /// A node's configuration for these flags (the simulated round trip).
    fn node_config(&self) -> NodeConfig {
        NodeConfig {
            simulated_rtt: (self.sim_rtt_ms > 0).then(|| Duration::from_millis(self.sim_rtt_ms)),
            ..NodeConfig::default()
        }
    }
}

/// One worker's view of one round.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct RoundSample {
    round: usize,
    matchmaking_s: f64,
    allreduce_s: f64,
    rel_error: f64,
    group: usize,
    bytes_sent: u64,
    /// Fraction of the vector this peer reduced.
    span_fraction: f64,
    /// Span transfers this peer sent over a fast lane.
    #[serde(default)]
    fast_lane_transfers: usize,
    /// Reducers this peer sent a span to.
    #[serde(default)]
    transfers: usize,
    /// When `step` was called and when it returned (seconds since the Unix epoch; the peers
    /// share one machine, so one clock).
    started_at: f64,
    finished_at: f64,
    /// Of the fast lane transfers, those on a lane kept from an earlier round.
    #[serde(default)]
    warm_lane_transfers: usize,
    /// A round of the plain-TCP reference butterfly (see `--reference`), not Starling's.
    #[serde(default)]
    reference: bool,
    /// The upload bandwidth (bytes/s) this peer declares after the round.
    #[serde(default)]
    bandwidth: f64,
    /// This round's measurement of the upload rate (bytes/s), if it sent enough to measure.
    #[serde(default)]
    measured_upload: Option<f64>,
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[derive(Serialize)]
struct AllreduceBench {
    bench: &'static str,
    peers: usize,
    size: usize,
    codec: String,
    procs: bool,
    rounds: usize,
    chunk_bytes: usize,
    /// Whether the fast lane was allowed, the share of span transfers that used it, and the
    /// share that used a lane kept warm from an earlier round.
    fast_lane: bool,
    fast_lane_share: f64,
    warm_lane_share: f64,
    /// Median over rounds of the time from the last peer's call to `step` to the last return.
    median_round_s: f64,
    /// Median over rounds of the last-arriving peer's matchmaking time.
    median_matchmaking_s: f64,
    /// Median over rounds of the slowest peer's all-reduce time.
    median_allreduce_s: f64,
    /// size * 4 bytes / median all-reduce time.
    algbw_gb_s: f64,
    /// algbw * 2 (n - 1) / n, comparable to NCCL's bus bandwidth.
    busbw_gb_s: f64,
    /// Bytes one peer put on the wire per round (median).
    bytes_sent_per_peer: u64,
    /// Median over rounds of the largest fraction of the vector one peer reduced (equal
    /// spans: 1 / peers), and of the ratio of the largest to the smallest declared bandwidth.
    median_max_span_fraction: f64,
    median_bandwidth_spread: f64,
    max_rel_error: f64,
    incomplete_rounds: usize,
    /// With `--kill`: the rounds after one peer was shut down, among the others.
    #[serde(skip_serializing_if = "Option::is_none")]
    after_kill: Option<Box<AllreduceBench>>,
    /// With `--reference`: the plain-TCP butterfly's rounds, same peers and data.
    #[serde(skip_serializing_if = "Option::is_none")]
    reference: Option<Box<AllreduceBench>>,
    /// With `--reference`: `median_allreduce_s` over the reference's.
    #[serde(skip_serializing_if = "Option::is_none")]
    vs_reference: Option<f64>,
}

/// Peer `index`'s data: the same in every mode and every process.
fn peer_data(index: usize, size: usize) -> Vec<f32> {
    normal(size, 1_000 + index as u64)
}

/// The exact mean of every peer's data (in f64, one peer's data in memory at a time).
fn exact_mean(peers: usize, size: usize) -> Vec<f32> {
    let mut mean = WeightedMean::default();
    for p in 0..peers {
        mean.add(&[peer_data(p, size)], 1.0);
    }
    mean.finish().remove(0)
}

fn averager_config(args: &AllreduceArgs) -> Result<AveragerConfig> {
    let mut c = AveragerConfig::new("bench-allreduce");
    c.codec = args.codec.parse().map_err(|e| anyhow!("--codec: {e}"))?;
    c.aggregation = args
        .aggregation
        .parse()
        .map_err(|e| anyhow!("--aggregation: {e}"))?;
    c.verify = args.verify;
    c.target_group_size = args.peers;
    c.min_group_size = args.peers;
    c.matchmaking_time = Duration::from_secs(30);
    if args.kill {
        // A peer will leave: the rest must be able to average without it, and a window as long
        // as a user's (the default) bounds how long its last declaration is waited for.
        c.min_group_size = (args.peers - 1).max(2);
        c.matchmaking_time = AveragerConfig::new("defaults").matchmaking_time;
    }
    c.sender_timeout = Duration::from_secs(30);
    c.reducer_timeout = Duration::from_secs(60);
    c.chunk_bytes = args.chunk_bytes;
    c.load_balance = !args.equal_spans;
    c.fast_lane = !args.no_fast_lane;
    Ok(c)
}

/// Runs `rounds + 1` steps on one averager; every round restarts from the peer's original data so
/// the exact mean is the same each time.
async fn worker_rounds(
    averager: &Averager,
    index: usize,
    args: &AllreduceArgs,
    mean: &[f32],
) -> Result<Vec<RoundSample>> {
    let original = peer_data(index, args.size);
    let mut samples = Vec::new();
    let mut data = original.clone();
    for round in 0..=args.rounds {
        data.copy_from_slice(&original);
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        if args.prepare_ms > 0 {
            averager.prepare(&[data.len()], deadline);
            tokio::time::sleep(Duration::from_millis(args.prepare_ms)).await;
        }
        let started_at = unix_now();
        let report = averager.step(&mut [&mut data[..]], 1.0, deadline).await?;
        let finished_at = unix_now();
        let me = report.group[report.my_index];
        let reduced: usize = report
            .spans
            .iter()
            .filter(|s| s.reducer == me)
            .map(|s| s.range.len())
            .sum();
        samples.push(RoundSample {
            span_fraction: reduced as f64 / args.size as f64,
            round,
            matchmaking_s: report.matchmaking_time.as_secs_f64(),
            allreduce_s: report.allreduce_time.as_secs_f64(),
            rel_error: relative_error(mean, &data),
            group: report.group.len(),
            bytes_sent: report.bytes_sent,
            started_at,
            finished_at,
            fast_lane_transfers: report.fast_lane_transfers,
            warm_lane_transfers: report.warm_lane_transfers,
            reference: false,
            bandwidth: averager.bandwidth(),
            measured_upload: report.measured_upload,
            transfers: report
                .spans
                .iter()
                .filter(|s| s.reducer != me)
                .map(|s| s.reducer)
                .collect::<std::collections::HashSet<_>>()
                .len(),
        });
    }
    Ok(samples)
}

/// Runs `rounds + 1` rounds of the plain-TCP reference butterfly (see `bench_reference`) on
/// `node`'s swarm, from the same data as [`worker_rounds`].
async fn reference_rounds(
    node: &Node,
    index: usize,
    args: &AllreduceArgs,
    mean: &[f32],
) -> Result<Vec<RoundSample>> {
    let codec = args.codec.parse().map_err(|e| anyhow!("--codec: {e}"))?;
    let mut butterfly =
        TcpButterfly::connect(node, index, args.peers, codec, args.chunk_bytes).await?;
    let original = peer_data(index, args.size);
    let mut data = original.clone();
    let mut samples = Vec::new();
    for round in 0..=args.rounds {
        data.copy_from_slice(&original);
        let started_at = unix_now();
        let t = Instant::now();
        let sent = butterfly.round(&mut data).await?;
        let elapsed = t.elapsed().as_secs_f64();
        samples.push(RoundSample {
            round,
            matchmaking_s: 0.0,
            allreduce_s: elapsed,
            rel_error: relative_error(mean, &data),
            group: args.peers,
            bytes_sent: sent,
            span_fraction: 1.0 / args.peers as f64,
            fast_lane_transfers: 0,
            transfers: args.peers - 1,
            started_at,
            finished_at: unix_now(),
            warm_lane_transfers: 0,
            reference: true,
            bandwidth: 0.0,
            measured_upload: None,
        });
    }
    Ok(samples)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

fn summarize(args: &AllreduceArgs, per_peer: Vec<Vec<RoundSample>>) -> AllreduceBench {
    let mut round_s = Vec::new();
    let mut mm_s = Vec::new();
    let mut ar_s = Vec::new();
    let mut sent = Vec::new();
    let (mut max_span, mut spread) = (Vec::new(), Vec::new());
    let mut max_err = 0.0f64;
    let mut incomplete = 0;
    let (mut fast, mut warm, mut transfers) = (0usize, 0usize, 0usize);
    let reference = per_peer.iter().flatten().any(|s| s.reference);
    for round in 1..=args.rounds {
        let samples: Vec<&RoundSample> = per_peer
            .iter()
            .filter_map(|s| {
                s.iter()
                    .find(|x| x.round == round && x.reference == reference)
            })
            .collect();
        if samples.len() < args.peers || samples.iter().any(|s| s.group < args.peers) {
            incomplete += 1;
        }
        // Peers reach `step` at different times (the harness checks each result and copies
        // fresh data between rounds), and the early ones wait in matchmaking for the last. So a
        // round is timed from the last peer's arrival to the last peer's return, and its
        // matchmaking is the last arrival's (the shortest).
        let last_in = samples.iter().map(|s| s.started_at).fold(0.0, f64::max);
        let last_out = samples.iter().map(|s| s.finished_at).fold(0.0, f64::max);
        mm_s.push(
            samples
                .iter()
                .map(|s| s.matchmaking_s)
                .fold(f64::INFINITY, f64::min),
        );
        ar_s.push(samples.iter().map(|s| s.allreduce_s).fold(0.0, f64::max));
        round_s.push(last_out - last_in);
        sent.extend(samples.iter().map(|s| s.bytes_sent as f64));
        max_span.push(samples.iter().map(|s| s.span_fraction).fold(0.0, f64::max));
        let bw = samples.iter().map(|s| s.bandwidth);
        let (lo, hi) = bw.fold((f64::INFINITY, 0.0f64), |(l, h), b| (l.min(b), h.max(b)));
        spread.push(if lo > 0.0 { hi / lo } else { 0.0 });
        fast += samples.iter().map(|s| s.fast_lane_transfers).sum::<usize>();
        warm += samples.iter().map(|s| s.warm_lane_transfers).sum::<usize>();
        transfers += samples.iter().map(|s| s.transfers).sum::<usize>();
        max_err = samples.iter().map(|s| s.rel_error).fold(max_err, f64::max);
    }
    let ar = median(ar_s.clone());
    let algbw = if ar > 0.0 {
        (args.size * 4) as f64 / ar / 1e9
    } else {
        0.0
    };
    let n = args.peers as f64;
    AllreduceBench {
        bench: "allreduce",
        peers: args.peers,
        size: args.size,
        codec: args.codec.clone(),
        procs: args.procs,
        rounds: args.rounds,
        chunk_bytes: args.chunk_bytes,
        fast_lane: !args.no_fast_lane && !reference,
        fast_lane_share: fast as f64 / transfers.max(1) as f64,
        warm_lane_share: warm as f64 / transfers.max(1) as f64,
        median_round_s: median(round_s),
        median_matchmaking_s: median(mm_s),
        median_allreduce_s: ar,
        algbw_gb_s: algbw,
        busbw_gb_s: algbw * 2.0 * (n - 1.0) / n,
        bytes_sent_per_peer: median(sent) as u64,
        median_max_span_fraction: median(max_span),
        median_bandwidth_spread: median(spread),
        max_rel_error: max_err,
        incomplete_rounds: incomplete,
        after_kill: None,
        reference: None,
        vs_reference: None,
    }
}

/// Starling's summary, with the reference's beside it when the samples hold reference rounds.
fn summarize_with_reference(
    args: &AllreduceArgs,
    per_peer: Vec<Vec<RoundSample>>,
) -> AllreduceBench {
    let (refs, own): (Vec<Vec<RoundSample>>, Vec<Vec<RoundSample>>) = per_peer
        .into_iter()
        .map(|s| s.into_iter().partition(|x| x.reference))
        .unzip();
    let mut result = summarize(args, own);
    if refs.iter().any(|r| !r.is_empty()) {
        let reference = summarize(args, refs);
        if reference.median_allreduce_s > 0.0 {
            result.vs_reference = Some(result.median_allreduce_s / reference.median_allreduce_s);
        }
        result.reference = Some(Box::new(reference));
    }
    result
}

/// Runs `starling bench allreduce`: every peer in this process, or one process per peer
/// (`--procs`), beside the plain-TCP reference butterfly when asked; prints one JSON object.
pub async fn run(args: AllreduceArgs) -> Result<()> {
    ensure!(args.peers >= 2, "--peers must be at least 2");
    ensure!(args.size >= 1, "--size must be at least 1");
    ensure!(args.rounds >= 1, "--rounds must be at least 1");
    let result = if args.procs {
        run_procs(&args).await?
    } else {
        run_in_process(&args).await?
    };
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

async fn run_in_process(args: &AllreduceArgs) -> Result<AllreduceBench> {
    let cfg = averager_config(args)?;
    let mean = exact_mean(args.peers, args.size);
    let swarm = AveragingSwarm::start(args.peers, args.node_config(), |_| cfg.clone()).await?;
    // Each peer runs its own loop of rounds (as a worker process does), not `step_all`: a peer
    // that finishes a round checks its result and starts the next one on its own time.
    let mut per_peer = match peer_loops(swarm.averagers(), args, &mean) {
        Ok(per_peer) => per_peer,
        Err(e) => {
            swarm.shutdown().await;
            return Err(e);
        }
    };
    if args.reference {
        let futs = swarm
            .nodes()
            .iter()
            .enumerate()
            .map(|(i, node)| reference_rounds(node, i, args, &mean));
        match futures::future::try_join_all(futs).await {
            Ok(refs) => per_peer
                .iter_mut()
                .zip(refs)
                .for_each(|(own, r)| own.extend(r)),
            Err(e) => {
                swarm.shutdown().await;
                return Err(e);
            }
        }
    }
    let mut result = summarize_with_reference(args, per_peer);
    if args.kill {
        let left = args.peers - 1;
        swarm.nodes()[left].shutdown().await;
        let after = AllreduceArgs {
            peers: left,
            ..args.clone()
        };
        let mean = exact_mean(left, args.size);
        match peer_loops(&swarm.averagers()[..left], &after, &mean) {
            Ok(per_peer) => {
                result.after_kill = Some(Box::new(summarize_with_reference(&after, per_peer)))
            }
            Err(e) => {
                swarm.shutdown().await;
                return Err(e);
            }
        }
    }
    swarm.shutdown().await;
    Ok(result)
}

/// Runs [`worker_rounds`] for every averager, each peer's loop on a thread of its own (the
/// averagers' own tasks stay on the runtime). Polled together in one task, the peers would take
/// turns: one peer checking its result (tens of milliseconds of arithmetic over the whole
/// vector) would hold up the others' rounds, most of all where members wait for each other
/// (a verified round's verdicts), which a peer in its own process never does.
fn peer_loops(
    averagers: &[Averager],
    args: &AllreduceArgs,
    mean: &[f32],
) -> Result<Vec<Vec<RoundSample>>> {
    let handle = tokio::runtime::Handle::current();
    tokio::task::block_in_place(|| {
        std::thread::scope(|s| {
            let loops: Vec<_> = averagers
                .iter()
                .enumerate()
                .map(|(i, a)| {
                    let handle = handle.clone();
                    s.spawn(move || handle.block_on(worker_rounds(a, i, args, mean)))
                })
                .collect();
            loops
                .into_iter()
                .map(|t| {
                    t.join()
                        .unwrap_or_else(|_| Err(anyhow!("a peer's loop panicked")))
                })
                .collect()
        })
    })
}

async fn run_procs(args: &AllreduceArgs) -> Result<AllreduceBench> {
    averager_config(args)?;
    let workers = crate::Workers::start(&args.netns, args.peers).await?;
    let mut children = Vec::new();
    for i in 0..args.peers {
        let child = workers
            .command("allreduce-worker", i)
            .args([
                "--peers",
                &args.peers.to_string(),
                "--size",
                &args.size.to_string(),
            ])
            .args(["--codec", &args.codec, "--rounds", &args.rounds.to_string()])
            .args(["--aggregation", &args.aggregation])
            .args(["--verify", &args.verify.to_string()])
            .args(["--chunk-bytes", &args.chunk_bytes.to_string()])
            .args(["--prepare-ms", &args.prepare_ms.to_string()])
            .args(["--sim-rtt-ms", &args.sim_rtt_ms.to_string()])
            .args(args.equal_spans.then_some("--equal-spans"))
            .args(args.no_fast_lane.then_some("--no-fast-lane"))
            .args(args.reference.then_some("--reference"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning a worker process")?;
        children.push(child);
    }
    let mut per_peer = Vec::new();
    for (i, mut child) in children.into_iter().enumerate() {
        let stdout = child.stdout.take().context("worker stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut samples = Vec::new();
        while let Some(line) = lines.next_line().await? {
            samples.push(
                serde_json::from_str::<RoundSample>(&line)
                    .with_context(|| format!("worker {i} printed {line:?}"))?,
            );
        }
        let status = child.wait().await?;
        if !status.success() {
            bail!("worker {i} failed ({status})");
        }
        per_peer.push(samples);
    }
    workers.boot.shutdown().await;
    Ok(summarize_with_reference(args, per_peer))
}

/// The flags of one worker process of `bench allreduce --procs`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[command(flatten)]
    common: AllreduceArgs,
    #[command(flatten)]
    place: crate::WorkerPlace,
    #[command(flatten)]
    nat: crate::NatArgs,
    /// Before the first round, wait up to this many seconds for autonat to judge whether this
    /// peer is reachable (a private one averages as a client); fail if it has not. 0: don't wait.
    #[arg(long, value_name = "SECS", default_value_t = 0)]
    await_reachability: u64,
}

/// Waits until autonat has judged `node`'s reachability, for at most `secs` seconds.
async fn await_reachability(node: &Node, secs: u64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let r = node.status().await?.reachability;
        if r != starling_node::Reachability::Unknown {
            tracing::info!(reachability = ?r, "reachability judged");
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "autonat did not judge this peer's reachability within {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// One peer of `bench allreduce --procs`: prints one JSON line per round.
pub async fn worker(args: WorkerArgs) -> Result<()> {
    let cfg = averager_config(&args.common)?;
    let started = Instant::now();
    let mut node_cfg = args
        .common
        .node_config()
        .bootstrap_from(args.place.bootstrap.clone());
    node_cfg.listen.extend(args.place.listen.clone());
    args.nat.apply(&mut node_cfg);
    let node = Node::start(node_cfg).await?;
    if args.await_reachability > 0 {
        await_reachability(&node, args.await_reachability).await?;
    }
    let averager = Averager::new(node.clone(), cfg).await?;
    let mean = exact_mean(args.common.peers, args.common.size);
    tracing::info!(
        index = args.place.index,
        setup_s = started.elapsed().as_secs_f64(),
        "worker ready"
    );
    let mut samples = worker_rounds(&averager, args.place.index, &args.common, &mean).await?;
    if args.common.reference {
        samples.extend(reference_rounds(&node, args.place.index, &args.common, &mean).await?);
    }
    for s in samples {
        println!("{}", serde_json::to_string(&s)?);
    }
    averager.shutdown().await;
    node.shutdown().await;
    Ok(())
}
