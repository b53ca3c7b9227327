//! `starling bench training`: where a collaborative global step's time goes (waiting for the
//! swarm's batch, averaging, optimizer) for a synthetic model, beside plain all-reduce rounds
//! of the same size measured in the same run (in-process peers on 127.0.0.1); with
//! `--sample-ms`, the swarm's throughput against the ideal under simulated compute
//! ([`simulated`]).

pub mod simulated;

use std::time::{Duration, Instant};

use crate::harness::AveragingSwarm;
use anyhow::{ensure, Context, Result};
use clap::Args;
use serde::Serialize;
use starling_averager::AveragerConfig;
use starling_compression::synthetic;
use starling_node::{cluster::LocalCluster, NodeConfig};
use starling_training::{
    CollaborativeConfig, CollaborativeOptimizer, Mode, ParamSet, Sgd, SgdConfig, StepTimings,
};

use crate::percentile;

/// Options of `starling bench training`.
#[derive(Args, Debug)]
pub struct TrainingArgs {
    /// Number of peers (all in one averaging group).
    #[arg(long, default_value_t = 4)]
    peers: usize,
    /// Parameters of the synthetic model (f32).
    #[arg(long, default_value_t = 10_000_000)]
    params: usize,
    /// Measured global steps (one extra warm-up step runs first; `--warmup` with
    /// `--sample-ms`).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Batches each peer contributes to one global step (without `--sample-ms`).
    #[arg(long, default_value_t = 4)]
    batches: usize,
    /// Codec on the wire; with --sample-ms also powersgd:RANK[:bf16] or dct-topk:CHUNK:K[:sign]
    /// (compressed gradient rounds; the parameters form a matrix of rows of 1000 when
    /// --params is a multiple of 1000 of at least 10^6).
    #[arg(long, default_value = "none")]
    codec: String,
    #[command(flatten)]
    sim: simulated::SimArgs,
}

#[derive(Serialize)]
struct TrainingBench {
    bench: &'static str,
    peers: usize,
    params: usize,
    steps: usize,
    codec: String,
    /// Median seconds per global step, over every peer's steps.
    median_waiting_s: f64,
    median_averaging_s: f64,
    median_optimizer_s: f64,
    /// Median seconds of a plain averaging round of the same size, same peers and codec.
    median_allreduce_reference_s: f64,
    /// `median_averaging_s / median_allreduce_reference_s`.
    averaging_over_reference: f64,
}

const BATCH_SAMPLES: u64 = 32;

fn averager_config(prefix: &str, args: &TrainingArgs) -> Result<AveragerConfig> {
    let mut c = AveragerConfig::new(prefix);
    c.target_group_size = args.peers;
    c.codec = args.codec.parse().context("codec")?;
    Ok(c)
}

/// Median seconds of `rounds` plain averaging rounds of `args.params` values.
async fn reference_rounds(args: &TrainingArgs, rounds: usize) -> Result<f64> {
    let cfg = averager_config("bench-training-reference", args)?;
    let swarm = AveragingSwarm::start(args.peers, NodeConfig::default(), |_| cfg.clone()).await?;
    let mut data: Vec<Vec<Vec<f32>>> = (0..args.peers)
        .map(|i| vec![synthetic::normal(args.params, i as u64 + 1)])
        .collect();
    let weights = vec![1.0; args.peers];
    let mut times = Vec::new();
    for round in 0..=rounds {
        let deadline = Instant::now() + Duration::from_secs(120);
        let reports = swarm.step_all(&mut data, &weights, deadline).await;
        let mut slowest = 0f64;
        for r in reports {
            let r = r.context("reference round")?;
            slowest = slowest.max((r.matchmaking_time + r.allreduce_time).as_secs_f64());
        }
        if round > 0 {
            times.push(slowest);
        }
    }
    swarm.shutdown().await;
    times.sort_by(f64::total_cmp);
    Ok(percentile(&times, 0.5))
}

/// One peer's collaborative training: `steps + 1` global steps over synthetic gradients.
async fn peer_steps(
    node: starling_node::Node,
    p: usize,
    args: &TrainingArgs,
) -> Result<Vec<StepTimings>> {
    let mut params = ParamSet::new();
    params.add("w", &[args.params], &synthetic::normal(args.params, 99))?;
    let grads = synthetic::normal(args.params, 1000 + p as u64);
    let opt = Sgd::new(SgdConfig::new(1e-3).momentum(0.9), params.len())?;
    let target = args.peers as u64 * args.batches as u64 * BATCH_SAMPLES;
    let mut cfg = CollaborativeConfig::new("bench-training", target, Mode::Gradients);
    cfg.averager = averager_config("bench-training", args)?;
    cfg.fetch_interval = Duration::from_millis(20);
    cfg.averaging_timeout = Duration::from_secs(120);
    cfg.state_averaging_every = None;
    // Every peer computes its `batches`, then waits with try_step.
    cfg.projected_batch = false;
    let mut collab = CollaborativeOptimizer::new(node, Box::new(opt), &params, cfg).await?;
    let mut timings = Vec::new();
    for step in 0..=args.steps {
        for _ in 0..args.batches {
            params.grads_mut().copy_from_slice(&grads);
            collab.step(&mut params, BATCH_SAMPLES).await?;
        }
        let mut r = collab.try_step(&mut params).await?;
        while !r.stepped {
            tokio::time::sleep(Duration::from_millis(5)).await;
            r = collab.try_step(&mut params).await?;
        }
        ensure!(
            r.group_size == Some(args.peers),
            "step {step}: averaged with {:?} peers ({:?})",
            r.group_size,
            r.averaging_error
        );
        if step > 0 {
            timings.push(r.timings);
        }
    }
    Ok(timings)
}

/// Runs the bench and prints one JSON object.
pub async fn run(args: TrainingArgs) -> Result<()> {
    ensure!(args.peers >= 2, "--peers must be at least 2");
    if args.sim.sample_ms.is_some() {
        ensure!(args.steps >= 1, "--steps must be at least 1");
        return simulated::run(&args).await;
    }
    ensure!(
        args.steps >= 1 && args.batches >= 1,
        "--steps and --batches must be at least 1"
    );
    let reference = reference_rounds(&args, args.steps).await?;
    let cluster = LocalCluster::start(args.peers, NodeConfig::default()).await?;
    let runs = cluster
        .nodes
        .iter()
        .enumerate()
        .map(|(p, node)| peer_steps(node.clone(), p, &args));
    let results = futures::future::join_all(runs).await;
    cluster.shutdown().await;
    let timings: Vec<StepTimings> = results
        .into_iter()
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    let median = |f: &dyn Fn(&StepTimings) -> Duration| {
        let mut v: Vec<f64> = timings.iter().map(|t| f(t).as_secs_f64()).collect();
        v.sort_by(f64::total_cmp);
        percentile(&v, 0.5)
    };
    let averaging = median(&|t| t.averaging);
    let out = TrainingBench {
        bench: "training",
        peers: args.peers,
        params: args.params,
        steps: args.steps,
        codec: args.codec.clone(),
        median_waiting_s: median(&|t| t.waiting),
        median_averaging_s: averaging,
        median_optimizer_s: median(&|t| t.optimizer),
        median_allreduce_reference_s: reference,
        averaging_over_reference: if reference > 0.0 {
            averaging / reference
        } else {
            0.0
        },
    };
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}
