//! Four peers train one linear model together. Each holds its own shard of noisy data
//! (`y = X w* + noise`), takes local SGD steps, and every 10 steps averages its parameters with
//! the others through `Averager::step`, weighted by how many samples it has. The averaged model
//! approaches `w*` faster than any peer alone.
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let truth = normal(DIM, 7);
    // Small, unequal shards: each alone overfits its noise.
    let shards: Vec<Shard> = (0..PEERS).map(|p| shard(p, 40 + 20 * p, &truth)).collect();
    let cluster = LocalCluster::start(PEERS, NodeConfig::default()).await?;
    let mut averagers = Vec::new();
    for node in &cluster.nodes {
        let mut cfg = AveragerConfig::new("collaborative-regression");
        cfg.target_group_size = PEERS;
        averagers.push(Averager::new(node.clone(), cfg).await?);
    }
    let mut models: Vec<Vec<f32>> = vec![vec![0.0; DIM]; PEERS];
    let mut alone: Vec<Vec<f32>> = vec![vec![0.0; DIM]; PEERS];
    for step in 1..=STEPS {
        for p in 0..PEERS {
            sgd_step(&mut models[p], &shards[p]);
            sgd_step(&mut alone[p], &shards[p]);
        }
        if step % AVERAGE_EVERY == 0 {
            let deadline = Instant::now() + Duration::from_secs(20);
            let rounds =
                averagers.iter().zip(models.iter_mut()).zip(&shards).map(
                    |((a, w), s)| async move {
                        a.step(&mut [&mut w[..]], s.y.len() as f32, deadline).await
                    },
                );
            for (p, r) in futures::future::join_all(rounds)
                .await
                .into_iter()
                .enumerate()
            {
                match r {
                    Ok(report) if p == 0 => println!(
                        "step {step:3}: averaged with {} peers in {:.1} ms; distance to w*: together {:.3}, peer 0 alone {:.3}",
                        report.group.len(),
                        report.allreduce_time.as_secs_f64() * 1e3,
                        distance(&models[0], &truth),
                        distance(&alone[0], &truth),
                    ),
                    Ok(_) => {}
                    Err(e) => eprintln!("peer {p}: no averaging this time ({e}); training goes on"),
                }
            }
        }
    }
    for a in averagers {
        a.shutdown().await;
    }
    cluster.shutdown().await;
    Ok(())
}
