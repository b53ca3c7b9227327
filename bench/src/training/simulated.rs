//! `starling bench training --sample-ms MS`: how close a swarm comes to N times one peer's
//! throughput. Each peer is its own process running the collaborative optimizer as
//! `starling train` does (projected global batch, default progress intervals, state averaging
//! every 10 epochs), and "computes" each batch by sleeping `MS` per sample, so that 16 peers
//! fit on 2 cores while the network, matchmaking, averaging and optimizer work are real.
//! With `--netns` the peers run in the given network namespaces (as root), listening with the
//! node's defaults, as on separate hosts (`scripts/bench_training_netns.sh` builds such hosts
//! with throttled links).
//!
//! The swarm's rate is the samples of the measured global steps over the time they took (from
//! the step that ends the warm-up to the last one, as the slowest peer saw them); the ideal is
//! N peers times one peer's compute rate (`1000 / MS` samples per second).

use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use starling_compression::synthetic;
use starling_node::{Node, NodeConfig};
use starling_training::{
    CollaborativeConfig, CollaborativeOptimizer, Mode, ParamSet, Sgd, SgdConfig, StepReport,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::TrainingArgs;
use crate::percentile;

/// Simulated compute (`bench training --sample-ms`).
#[derive(Args, Debug, Clone)]
pub struct SimArgs {
    /// Simulate compute: every peer is a process that "computes" each batch by sleeping this
    /// many milliseconds per sample, and the bench reports the swarm's samples per second
    /// against N times one peer's rate. Without it, the bench compares averaging with plain
    /// all-reduce rounds (in-process peers).
    #[arg(long, value_name = "MS")]
    pub sample_ms: Option<f64>,
    /// Simulated compute: samples per global step (the run's target batch size).
    #[arg(long, default_value_t = 1024)]
    pub target: u64,
    /// Simulated compute: samples per batch.
    #[arg(long, default_value_t = 32)]
    pub batch: u64,
    /// Simulated compute: global steps before the measured ones (`--steps`).
    #[arg(long, default_value_t = 3)]
    pub warmup: u64,
    /// Simulated compute: apply each step one epoch late, averaging while computing.
    #[arg(long)]
    pub delayed_update: bool,
    /// Simulated compute, with --delayed-update: the part of the next batch computed before
    /// the step in flight must be applied (`CollaborativeConfig::delayed_max_stale`; default
    /// its default).
    #[arg(long, value_name = "FRACTION", requires = "delayed_update")]
    pub max_stale: Option<f64>,
    /// Simulated compute: run peer i in network namespace i (comma-separated, one per peer;
    /// needs root; the bench runs inside the first one).
    #[arg(long, value_delimiter = ',')]
    pub netns: Vec<String>,
    /// Simulated compute: a simulated round-trip time between the peers, in milliseconds
    /// (`NodeConfig::simulated_rtt`: each peer's TCP reads are held back half of it; a
    /// simulation for this kernel, which has no netem; QUIC is off).
    #[arg(long, value_name = "MS")]
    pub sim_rtt_ms: Option<u64>,
    /// Simulated compute: also list every measured step (each peer's samples, group size and
    /// time) in the result.
    #[arg(long)]
    pub per_step: bool,
}

/// One simulated peer (started by `bench training --sample-ms`).
#[derive(Args, Debug)]
pub struct SimWorkerArgs {
    #[command(flatten)]
    common: TrainingArgs,
    #[command(flatten)]
    place: crate::WorkerPlace,
}

/// What a worker prints, one JSON object per line.
#[derive(Serialize, Deserialize, Debug)]
#[serde(rename_all = "snake_case")]
enum Line {
    /// Its node and optimizer are up: it waits for `go` on stdin.
    Ready,
    /// A global step it took.
    Step(StepLine),
    /// It reached the last epoch.
    Done { params_sha256: String },
}

#[derive(Serialize, Deserialize, Debug, Clone)]
struct StepLine {
    epoch: u64,
    /// This peer's samples in the step.
    samples: u64,
    group_size: Option<usize>,
    /// Whether the round failed or averaged only part of the values.
    failed: bool,
    /// Every failure the step met (round, progress reads and writes).
    errors: Vec<String>,
    waiting_s: f64,
    matchmaking_s: f64,
    allreduce_s: f64,
    averaging_s: f64,
    optimizer_s: f64,
    /// Seconds this peer spent in the epoch's other calls of `step` (progress reads and
    /// writes between batches: time the training loop does not compute).
    batch_calls_s: f64,
    /// When the step was taken (unix ms; one clock for every process of this machine).
    at_ms: u64,
}

impl StepLine {
    fn of(r: &StepReport, batch_calls: Duration) -> Self {
        StepLine {
            epoch: r.epoch,
            samples: r.samples,
            group_size: r.group_size,
            failed: r.averaging_error.is_some(),
            errors: r.errors.clone(),
            waiting_s: r.timings.waiting.as_secs_f64(),
            matchmaking_s: r
                .round
                .as_ref()
                .map_or(0.0, |x| x.matchmaking_time.as_secs_f64()),
            allreduce_s: r
                .round
                .as_ref()
                .map_or(0.0, |x| x.allreduce_time.as_secs_f64()),
            averaging_s: r.timings.averaging.as_secs_f64(),
            optimizer_s: r.timings.optimizer.as_secs_f64(),
            batch_calls_s: batch_calls.as_secs_f64(),
            at_ms: starling_dht::now_ms(),
        }
    }
}

/// The bench's result.
#[derive(Serialize, Debug)]
struct SimBench {
    bench: &'static str,
    peers: usize,
    params: usize,
    codec: String,
    delayed_update: bool,
    /// `--max-stale`, if given.
    max_stale: Option<f64>,
    netns: bool,
    /// The simulated round-trip time between peers (`--sim-rtt-ms`), if any.
    sim_rtt_ms: Option<u64>,
    sample_ms: f64,
    target_batch_size: u64,
    batch: u64,
    measured_steps: u64,
    /// The swarm's samples per second over the measured steps.
    samples_per_second: f64,
    /// N peers x one peer's compute rate.
    ideal_samples_per_second: f64,
    /// `samples_per_second / ideal_samples_per_second`.
    vs_ideal: f64,
    /// Seconds per global step at the ideal rate, and measured.
    ideal_step_s: f64,
    step_s: f64,
    mean_global_batch: f64,
    max_global_batch: u64,
    min_global_batch: u64,
    /// Peer-steps whose round failed or averaged only part of the values.
    failed_rounds: usize,
    /// Peer-steps whose round formed a group smaller than the swarm.
    partial_groups: usize,
    /// Every failure reported in the measured steps (round, progress), all peers.
    errors: usize,
    /// Median seconds per peer-step: from the epoch's first batch to the round (compute and
    /// waiting for the swarm's batch), matchmaking, all-reduce, the whole round, the update.
    median_waiting_s: f64,
    median_matchmaking_s: f64,
    median_allreduce_s: f64,
    median_averaging_s: f64,
    median_optimizer_s: f64,
    median_batch_calls_s: f64,
    /// Whether every peer ended with the same parameters (SHA-256 of their bits).
    identical: bool,
    /// Seconds from `go` until every peer was done.
    wall_s: f64,
    /// With `--per-step`: every measured step.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    per_step: Vec<StepSummary>,
}

/// One global step as every peer reported it (`--per-step`).
#[derive(Serialize, Debug)]
struct StepSummary {
    epoch: u64,
    /// Each peer's samples, group size and time (ms after the first peer's) in the step.
    samples: Vec<u64>,
    groups: Vec<Option<usize>>,
    at_ms: Vec<u64>,
}

/// One peer: joins through `bootstrap`, waits for `go`, trains `warmup + steps` epochs.
pub async fn worker(args: SimWorkerArgs) -> Result<()> {
    let common = &args.common;
    let sim = &common.sim;
    let sample_ms = sim.sample_ms.context("--sample-ms")?;
    let mut node_cfg = NodeConfig::default().bootstrap_from(args.place.bootstrap.clone());
    node_cfg.listen.extend(args.place.listen.clone());
    node_cfg.simulated_rtt = sim.sim_rtt_ms.map(Duration::from_millis);
    let node = Node::start(node_cfg).await?;
    let n = common.params;
    let mut params = ParamSet::new();
    // A matrix of rows of 1000 when the size allows (what low-rank compression works on), as a
    // model's weights are; else one vector.
    let shape = if n >= 1_000_000 && n.is_multiple_of(1000) {
        vec![n / 1000, 1000]
    } else {
        vec![n]
    };
    params.add("w", &shape, &synthetic::normal(n, 99))?;
    let grads: Vec<f32> = synthetic::normal(n, 1000 + args.place.index as u64)
        .into_iter()
        .map(|g| g * 1e-3)
        .collect();
    let opt = Sgd::new(SgdConfig::new(1e-2), n)?;
    let mut cfg = CollaborativeConfig::new("bench-training-sim", sim.target, Mode::Gradients);
    cfg.averager.target_group_size = common.peers;
    (cfg.averager.codec, cfg.compression) =
        starling_training::GradientCompression::parse_codec(&common.codec)
            .map_err(|e| anyhow::anyhow!("codec: {e}"))?;
    cfg.delayed_update = sim.delayed_update;
    if let Some(f) = sim.max_stale {
        cfg.delayed_max_stale = f;
    }
    let mut collab = CollaborativeOptimizer::new(node.clone(), Box::new(opt), &params, cfg).await?;
    print_line(&Line::Ready)?;
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    match stdin.next_line().await? {
        Some(l) if l.trim() == "go" => {}
        other => bail!("expected `go` on stdin, got {other:?}"),
    }
    let compute = Duration::from_secs_f64(sim.batch as f64 * sample_ms / 1000.0);
    let epochs = sim.warmup + common.steps as u64;
    let mut batch_calls = Duration::ZERO;
    while collab.epoch() < epochs {
        tokio::time::sleep(compute).await;
        params.grads_mut().copy_from_slice(&grads);
        let called = Instant::now();
        let r = collab.step(&mut params, sim.batch).await?;
        if r.stepped {
            print_line(&Line::Step(StepLine::of(&r, batch_calls)))?;
            batch_calls = Duration::ZERO;
        } else {
            batch_calls += called.elapsed();
        }
    }
    if let Some(r) = collab.flush(&mut params).await? {
        print_line(&Line::Step(StepLine::of(&r, batch_calls)))?;
    }
    print_line(&Line::Done {
        params_sha256: starling_run::session::params_sha256(params.params()),
    })?;
    // The others may still be in their last round with this peer: leave after a moment.
    tokio::time::sleep(Duration::from_secs(1)).await;
    collab.shutdown().await;
    node.shutdown().await;
    Ok(())
}

fn print_line(line: &Line) -> Result<()> {
    println!("{}", serde_json::to_string(line)?);
    Ok(())
}

/// What the bench collects from one worker.
struct Worker {
    steps: Vec<StepLine>,
    sha: Option<String>,
}

/// Starts the workers, starts them together, collects their steps and prints the result.
pub async fn run(args: &TrainingArgs) -> Result<()> {
    let sim = &args.sim;
    let sample_ms = sim.sample_ms.context("--sample-ms")?;
    ensure!(
        sample_ms.is_finite() && sample_ms > 0.0,
        "--sample-ms must be positive"
    );
    ensure!(
        sim.batch >= 1 && sim.target >= sim.batch,
        "--batch must be at least 1 and at most --target"
    );
    let hosts = crate::Workers::start(&sim.netns, args.peers).await?;
    let mut children = Vec::new();
    for i in 0..args.peers {
        let child = hosts
            .command("training-worker", i)
            .args(["--peers", &args.peers.to_string()])
            .args(["--params", &args.params.to_string()])
            .args(["--steps", &args.steps.to_string()])
            .args(["--codec", &args.codec])
            .args(["--sample-ms", &sample_ms.to_string()])
            .args(["--target", &sim.target.to_string()])
            .args(["--batch", &sim.batch.to_string()])
            .args(["--warmup", &sim.warmup.to_string()])
            .args(sim.delayed_update.then_some("--delayed-update"))
            .args(
                sim.max_stale
                    .map(|f| ["--max-stale".to_string(), f.to_string()])
                    .into_iter()
                    .flatten(),
            )
            .args(sim.per_step.then_some("--per-step"))
            .args(
                sim.sim_rtt_ms
                    .map(|ms| ["--sim-rtt-ms".to_string(), ms.to_string()])
                    .into_iter()
                    .flatten(),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning a worker process")?;
        children.push(child);
    }
    // Every worker's lines, read as they come; `Ready` is signalled on its own.
    let mut readers = Vec::new();
    let mut ready = Vec::new();
    for (i, child) in children.iter_mut().enumerate() {
        let stdout = child.stdout.take().context("worker stdout")?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        ready.push(rx);
        readers.push(tokio::spawn(read_worker(i, stdout, tx)));
    }
    for (i, rx) in ready.into_iter().enumerate() {
        tokio::time::timeout(Duration::from_secs(120), rx)
            .await
            .with_context(|| format!("worker {i} was not ready within 120 s"))?
            .with_context(|| format!("worker {i} exited before it was ready"))?;
    }
    let go = Instant::now();
    for child in &mut children {
        let stdin = child.stdin.as_mut().context("worker stdin")?;
        stdin.write_all(b"go\n").await?;
        stdin.flush().await?;
    }
    let mut workers = Vec::new();
    for (i, (reader, mut child)) in readers.into_iter().zip(children).enumerate() {
        workers.push(reader.await??);
        let status = child.wait().await?;
        ensure!(status.success(), "worker {i} failed ({status})");
    }
    let wall_s = go.elapsed().as_secs_f64();
    hosts.boot.shutdown().await;
    let result = summarize(args, sample_ms, workers, wall_s)?;
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

/// Reads worker `i`'s lines until it exits.
async fn read_worker(
    i: usize,
    stdout: tokio::process::ChildStdout,
    ready: tokio::sync::oneshot::Sender<()>,
) -> Result<Worker> {
    let mut lines = BufReader::new(stdout).lines();
    let mut ready = Some(ready);
    let mut w = Worker {
        steps: Vec::new(),
        sha: None,
    };
    while let Some(line) = lines.next_line().await? {
        match serde_json::from_str::<Line>(&line)
            .with_context(|| format!("worker {i} printed {line:?}"))?
        {
            Line::Ready => {
                if let Some(tx) = ready.take() {
                    let _ = tx.send(());
                }
            }
            Line::Step(s) => w.steps.push(s),
            Line::Done { params_sha256 } => w.sha = Some(params_sha256),
        }
    }
    Ok(w)
}

fn summarize(
    args: &TrainingArgs,
    sample_ms: f64,
    workers: Vec<Worker>,
    wall_s: f64,
) -> Result<SimBench> {
    let sim = &args.sim;
    let first = sim.warmup;
    let last = sim.warmup + args.steps as u64;
    let measured = |s: &&StepLine| s.epoch > first && s.epoch <= last;
    // When the slowest peer took step `e`.
    let at = |e: u64| -> Result<u64> {
        workers
            .iter()
            .flat_map(|w| &w.steps)
            .filter(|s| s.epoch == e)
            .map(|s| s.at_ms)
            .max()
            .with_context(|| format!("no peer took step {e}"))
    };
    let (t0, t1) = (at(first)?, at(last)?);
    let mut batches = Vec::new();
    for e in first + 1..=last {
        let b: u64 = workers
            .iter()
            .flat_map(|w| &w.steps)
            .filter(|s| s.epoch == e)
            .map(|s| s.samples)
            .sum();
        batches.push(b);
    }
    let samples: u64 = batches.iter().sum();
    let seconds = (t1.saturating_sub(t0) as f64 / 1000.0).max(1e-3);
    let rate = samples as f64 / seconds;
    let ideal = args.peers as f64 * 1000.0 / sample_ms;
    let steps: Vec<&StepLine> = workers
        .iter()
        .flat_map(|w| &w.steps)
        .filter(measured)
        .collect();
    let median = |f: &dyn Fn(&StepLine) -> f64| {
        let mut v: Vec<f64> = steps.iter().map(|s| f(s)).collect();
        v.sort_by(f64::total_cmp);
        percentile(&v, 0.5)
    };
    let per_step = if sim.per_step {
        (first + 1..=last)
            .map(|e| {
                let of_e: Vec<&StepLine> = workers
                    .iter()
                    .filter_map(|w| w.steps.iter().find(|s| s.epoch == e))
                    .collect();
                let t0 = of_e.iter().map(|s| s.at_ms).min().unwrap_or(0);
                StepSummary {
                    epoch: e,
                    samples: of_e.iter().map(|s| s.samples).collect(),
                    groups: of_e.iter().map(|s| s.group_size).collect(),
                    at_ms: of_e.iter().map(|s| s.at_ms - t0).collect(),
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    let shas: Vec<&Option<String>> = workers.iter().map(|w| &w.sha).collect();
    Ok(SimBench {
        bench: "training-simulated",
        peers: args.peers,
        params: args.params,
        codec: args.codec.clone(),
        delayed_update: sim.delayed_update,
        max_stale: sim.max_stale,
        netns: !sim.netns.is_empty(),
        sim_rtt_ms: sim.sim_rtt_ms,
        sample_ms,
        target_batch_size: sim.target,
        batch: sim.batch,
        measured_steps: args.steps as u64,
        samples_per_second: rate,
        ideal_samples_per_second: ideal,
        vs_ideal: rate / ideal,
        ideal_step_s: sim.target as f64 / ideal,
        step_s: seconds / args.steps as f64,
        mean_global_batch: samples as f64 / batches.len().max(1) as f64,
        max_global_batch: batches.iter().copied().max().unwrap_or(0),
        min_global_batch: batches.iter().copied().min().unwrap_or(0),
        failed_rounds: steps.iter().filter(|s| s.failed).count(),
        partial_groups: steps
            .iter()
            .filter(|s| !s.failed && s.group_size != Some(args.peers))
            .count(),
        errors: steps.iter().map(|s| s.errors.len()).sum(),
        median_waiting_s: median(&|s| s.waiting_s),
        median_matchmaking_s: median(&|s| s.matchmaking_s),
        median_allreduce_s: median(&|s| s.allreduce_s),
        median_averaging_s: median(&|s| s.averaging_s),
        median_optimizer_s: median(&|s| s.optimizer_s),
        median_batch_calls_s: median(&|s| s.batch_calls_s),
        identical: shas.iter().all(|s| s.is_some() && *s == shas[0]),
        wall_s,
        per_step,
    })
}
