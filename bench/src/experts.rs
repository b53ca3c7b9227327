//! `starling bench experts`: throughput and latency of one expert server under many clients.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use clap::Args;
use serde::Serialize;
use starling_experts::candle_core::{Device, Tensor};
use starling_experts::{
    ActivationReuse, ClientConfig, Expert, ExpertClient, ExpertServer, ExpertSpec, RemoteExpert,
    ServerConfig,
};
use starling_node::{cluster::LocalCluster, NodeConfig};

/// How a server keeps forward activations for backwards (`starling experts serve`, `starling bench experts`).
#[derive(Args, Debug, Clone, Copy)]
pub struct ReuseArgs {
    /// Memory for forward activations kept until their backward (MiB, all experts together);
    /// 0 recomputes them in every backward.
    #[arg(long, default_value_t = 128, value_name = "MIB")]
    activation_cache_mb: usize,
    /// Optimizer steps an expert may take between a request's forward and its backward for the
    /// kept activations to be used (0: only when the expert has not stepped, exact).
    #[arg(long, default_value_t = 32)]
    max_stale_steps: u64,
}

impl ReuseArgs {
    /// The server setting.
    pub fn reuse(&self) -> ActivationReuse {
        ActivationReuse {
            max_bytes: self.activation_cache_mb << 20,
            max_stale_steps: self.max_stale_steps,
        }
    }
}

/// The flags of `starling bench experts`.
#[derive(Args, Debug)]
pub struct ExpertsBenchArgs {
    /// Clients, each its own peer, calling at the same time.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Samples per request.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Expert width (feed-forward expert hidden -> ffn-mult x hidden -> hidden).
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Inner width multiple.
    #[arg(long, default_value_t = 4)]
    ffn_mult: usize,
    /// Experts hosted; clients call them round-robin.
    #[arg(long, default_value_t = 1)]
    experts: usize,
    /// Seconds per phase (forward-only, then forward+backward).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Payload codec.
    #[arg(long, default_value = "none")]
    codec: String,
    #[command(flatten)]
    reuse: ReuseArgs,
}

#[derive(Serialize)]
struct Phase {
    requests: usize,
    failed: usize,
    samples_per_s: f64,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
}

#[derive(Serialize)]
struct Report {
    clients: usize,
    batch: usize,
    hidden: usize,
    experts: usize,
    parameters_per_expert: usize,
    codec: String,
    forward: Phase,
    forward_backward: Phase,
    server_batches: u64,
    mean_batch_samples: f64,
    /// Server compute per sample, microseconds, by phase (forward batches; and of backward
    /// batches, recomputing the forward, the gradients, the optimizer), over the whole run.
    server_us_per_sample: PhaseCost,
    /// Backward samples that reused their forward's activations instead of recomputing them.
    reused_fraction: f64,
}

#[derive(Serialize)]
struct PhaseCost {
    forward: f64,
    recompute: f64,
    gradients: f64,
    optimizer: f64,
}

async fn phase(
    experts: &[RemoteExpert],
    inputs: &[Tensor],
    seconds: f64,
    backward: bool,
    batch: usize,
) -> Phase {
    let started = Instant::now();
    let until = started + Duration::from_secs_f64(seconds);
    let runs = experts.iter().zip(inputs).map(|(e, x)| async move {
        let mut lat = Vec::new();
        let mut failed = 0;
        while Instant::now() < until {
            let t = Instant::now();
            let ok = match e.forward(x).await {
                Ok(y) if backward => e.backward(x, &y.ones_like().unwrap_or(y)).await.is_ok(),
                Ok(_) => true,
                Err(_) => false,
            };
            if ok {
                lat.push(t.elapsed().as_secs_f64() * 1e3);
            } else {
                failed += 1;
            }
        }
        (lat, failed)
    });
    let results = futures::future::join_all(runs).await;
    let elapsed = started.elapsed().as_secs_f64();
    let mut lat: Vec<f64> = results
        .iter()
        .flat_map(|(l, _)| l.iter().copied())
        .collect();
    let failed = results.iter().map(|(_, f)| f).sum();
    lat.sort_by(f64::total_cmp);
    let pct = |p| crate::percentile(&lat, p);
    Phase {
        requests: lat.len(),
        failed,
        samples_per_s: (lat.len() * batch) as f64 / elapsed,
        p50_ms: pct(0.5),
        p90_ms: pct(0.9),
        p99_ms: pct(0.99),
    }
}

/// Runs `starling bench experts` and prints its JSON report.
pub async fn run(args: ExpertsBenchArgs) -> Result<()> {
    ensure!(
        args.clients >= 1 && args.batch >= 1 && args.hidden >= 1 && args.experts >= 1,
        "sizes must be positive"
    );
    ensure!(args.seconds > 0.0, "--seconds must be positive");
    let codec = args
        .codec
        .parse()
        .map_err(|e| anyhow::anyhow!("--codec: {e}"))?;
    let cluster = LocalCluster::start(args.clients + 1, NodeConfig::default()).await?;
    let spec = ExpertSpec::ffn(args.hidden, args.hidden * args.ffn_mult);
    let uids: Vec<String> = (0..args.experts).map(|i| format!("bench.{i}")).collect();
    let hosted = uids
        .iter()
        .enumerate()
        .map(|(i, u)| Ok((u.clone(), Expert::new(&spec, i as u64)?)))
        .collect::<Result<Vec<_>>>()?;
    let params = hosted[0].1.num_parameters();
    let server_cfg = ServerConfig {
        max_request_rows: args.batch.max(4096),
        max_queue_rows: (args.batch * args.clients * 2).max(32_768),
        activation_reuse: args.reuse.reuse(),
        ..ServerConfig::default()
    };
    let server = ExpertServer::start(cluster.nodes[0].clone(), hosted, server_cfg).await?;
    let server_peer = cluster.nodes[0].peer_id();
    let addrs = cluster.nodes[0].listen_addrs().await?;
    let client_cfg = ClientConfig {
        codec,
        forward_timeout: Duration::from_secs(120),
        backward_timeout: Duration::from_secs(120),
        ..ClientConfig::default()
    };
    let experts: Vec<RemoteExpert> = (0..args.clients)
        .map(|c| {
            ExpertClient::new(cluster.nodes[c + 1].clone(), client_cfg.clone()).expert(
                &uids[c % uids.len()],
                server_peer,
                addrs.clone(),
            )
        })
        .collect();
    let inputs = (0..args.clients)
        .map(|_| Tensor::randn(0f32, 1.0, (args.batch, args.hidden), &Device::Cpu))
        .collect::<Result<Vec<_>, _>>()?;
    // Warm up: connections, streams, allocator.
    for (e, x) in experts.iter().zip(&inputs) {
        e.forward(x).await?;
    }
    let base_batches = server.stats().batches.load(Ordering::Relaxed);
    let base_rows = server.stats().rows.load(Ordering::Relaxed);
    let phase_ns = |s: &starling_experts::ServerStats| {
        [
            &s.forward_ns,
            &s.recompute_ns,
            &s.gradients_ns,
            &s.optimizer_ns,
            &s.reused_rows,
            &s.backward_rows,
        ]
        .map(|a| a.load(Ordering::Relaxed))
    };
    let base_phases = phase_ns(server.stats());
    let forward = phase(&experts, &inputs, args.seconds, false, args.batch).await;
    let forward_backward = phase(&experts, &inputs, args.seconds, true, args.batch).await;
    let batches = server.stats().batches.load(Ordering::Relaxed) - base_batches;
    let rows = server.stats().rows.load(Ordering::Relaxed) - base_rows;
    let phases = phase_ns(server.stats());
    // Forward rows: those of the forward phase plus the forward half of forward+backward.
    let fwd_rows =
        ((forward.samples_per_s + forward_backward.samples_per_s) * args.seconds).max(1.0);
    let bwd_rows = (forward_backward.samples_per_s * args.seconds).max(1.0);
    let us = |i: usize, n: f64| (phases[i] - base_phases[i]) as f64 / 1e3 / n;
    let server_us_per_sample = PhaseCost {
        forward: us(0, fwd_rows),
        recompute: us(1, bwd_rows),
        gradients: us(2, bwd_rows),
        optimizer: us(3, bwd_rows),
    };
    let report = Report {
        clients: args.clients,
        batch: args.batch,
        hidden: args.hidden,
        experts: args.experts,
        parameters_per_expert: params,
        codec: args.codec.clone(),
        forward,
        forward_backward,
        server_batches: batches,
        mean_batch_samples: rows as f64 / batches.max(1) as f64,
        server_us_per_sample,
        reused_fraction: (phases[4] - base_phases[4]) as f64
            / (phases[5] - base_phases[5]).max(1) as f64,
    };
    println!("{}", serde_json::to_string(&report)?);
    server.shutdown().await?;
    cluster.shutdown().await;
    Ok(())
}
