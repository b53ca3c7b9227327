//! Four peers train one linear model together. Each holds its own shard of noisy data
//! (`y = X w* + noise`), takes local SGD steps, and every 10 steps averages its parameters with
//! the others, weighted by how many samples it has. The averaged model approaches `w*` faster
//! than any peer alone.
//!
//! Each peer's training loop is a plain synchronous loop on its own thread: the model compute
//! runs there, and it averages with the blocking [`Averager::step_blocking`]. The network (the
//! nodes and the averagers' tasks) runs on a multi-threaded tokio runtime of its own. Compute
//! stays off the runtime's worker threads because there it would starve the tasks that move the
//! averaging data (measured in the averager crate: it tripled round times); with `async` code,
//! the same rule means `tokio::task::spawn_blocking` for each compute step.
//!
//! `cargo run --release -p starling-examples --example collaborative_regression`

use std::time::{Duration, Instant};

use starling_averager::{Averager, AveragerConfig};
use starling_compression::synthetic::normal;
use starling_node::{cluster::LocalCluster, NodeConfig};

const DIM: usize = 64;
const PEERS: usize = 4;
const STEPS: usize = 200;
const AVERAGE_EVERY: usize = 10;
const LR: f32 = 0.05;

struct Shard {
    x: Vec<f32>, // rows of DIM
    y: Vec<f32>,
}

fn shard(peer: usize, rows: usize, truth: &[f32]) -> Shard {
    let x = normal(rows * DIM, 100 + peer as u64);
    let noise = normal(rows, 200 + peer as u64);
    let y = (0..rows)
        .map(|r| {
            x[r * DIM..(r + 1) * DIM]
                .iter()
                .zip(truth)
                .map(|(a, b)| a * b)
                .sum::<f32>()
                + 0.5 * noise[r]
        })
        .collect();
    Shard { x, y }
}

/// One full-batch gradient step on the mean squared error; returns the loss before the step.
fn sgd_step(w: &mut [f32], s: &Shard) -> f32 {
    let rows = s.y.len();
    let mut grad = vec![0.0f32; DIM];
    let mut loss = 0.0f32;
    for r in 0..rows {
        let row = &s.x[r * DIM..(r + 1) * DIM];
        let err = row.iter().zip(w.iter()).map(|(a, b)| a * b).sum::<f32>() - s.y[r];
        loss += err * err;
        for (g, a) in grad.iter_mut().zip(row) {
            *g += 2.0 * err * a / rows as f32;
        }
    }
    for (wi, g) in w.iter_mut().zip(&grad) {
        *wi -= LR * g;
    }
    loss / rows as f32
}

fn distance(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f32>()
        .sqrt()
}

/// One peer's training loop, on its own thread: local SGD steps, and every `AVERAGE_EVERY` steps
/// a blocking averaging step weighted by the shard's size. Next to it, the same peer trains a
/// model alone for comparison. Peer 0 reports each averaging round.
fn train(p: usize, averager: &Averager, shard: &Shard, truth: &[f32]) {
    let mut model = vec![0.0f32; DIM];
    let mut alone = vec![0.0f32; DIM];
    for step in 1..=STEPS {
        sgd_step(&mut model, shard);
        sgd_step(&mut alone, shard);
        if step % AVERAGE_EVERY == 0 {
            let deadline = Instant::now() + Duration::from_secs(20);
            match averager.step_blocking(&mut [&mut model[..]], shard.y.len() as f32, deadline) {
                Ok(report) if p == 0 => println!(
                    "step {step:3}: averaged with {} peers in {:.1} ms; distance to w*: together {:.3}, peer 0 alone {:.3}",
                    report.group.len(),
                    report.allreduce_time.as_secs_f64() * 1e3,
                    distance(&model, truth),
                    distance(&alone, truth),
                ),
                Ok(_) => {}
                Err(e) => eprintln!("peer {p}: no averaging this time ({e}); training goes on"),
            }
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let truth = normal(DIM, 7);
    // Small, unequal shards: each alone overfits its noise.
    let shards: Vec<Shard> = (0..PEERS).map(|p| shard(p, 40 + 20 * p, &truth)).collect();
    // The network's threads; the training loops below run on threads of their own.
    let rt = tokio::runtime::Runtime::new()?;
    let cluster = rt.block_on(LocalCluster::start(PEERS, NodeConfig::default()))?;
    let mut averagers = Vec::new();
    for node in &cluster.nodes {
        let mut cfg = AveragerConfig::new("collaborative-regression");
        cfg.target_group_size = PEERS;
        averagers.push(rt.block_on(Averager::new(node.clone(), cfg))?);
    }
    std::thread::scope(|s| {
        for (p, (averager, shard)) in averagers.iter().zip(&shards).enumerate() {
            let truth = &truth;
            s.spawn(move || train(p, averager, shard, truth));
        }
    });
    rt.block_on(async {
        for a in averagers {
            a.shutdown().await;
        }
        cluster.shutdown().await;
    });
    Ok(())
}
