//! Eight peers train the digits softmax classifier in gradient mode while two of them lie about
//! their gradients; the reducers' aggregation decides whether the lie lands.
//!
//! - `noise_breaks_the_mean_and_no_attack_gets_through_centered_clipping`: two peers send
//!   Gaussian noise of 100x their gradient's norm; with `mean` the model is ruined, with
//!   `centered-clip` the honest peers end within 2 points of an attack-free run, and so they do
//!   when the two send their gradient x100.
//! - `attacks_by_aggregators_table` (ignored; run it by name, `--release`) prints final accuracy
//!   for every attack (x100, sign flip, Gaussian noise of 100x the gradient norm, "a little is
//!   enough") under every aggregator.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use starling_averager::Aggregation;
use starling_node::{cluster::LocalCluster, NodeConfig};
use starling_tests::{bounded, init_tracing};
use starling_training::{CollaborativeOptimizer, Mode, Sgd};

#[path = "support/digits.rs"]
mod digits;

use digits::{accuracy, collab_cfg, digits, gradient, model, sgd, Data, BATCH, BATCHES_PER_EPOCH};

/// Peers in the run; the last [`LIARS`] lie.
const N: usize = 8;
const LIARS: usize = 2;
const EPOCHS: usize = 12;

/// What a lying peer sends instead of its gradient.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Attack {
    None,
    /// The gradient times 100.
    Scale,
    /// The gradient with its sign flipped.
    SignFlip,
    /// Gaussian noise with 100x the gradient's norm.
    Noise,
    /// "A little is enough" (Baruch et al. 2019): the mean of the honest gradients minus z
    /// standard deviations, coordinate-wise, with z from the paper for N peers and LIARS liars.
    ALittle,
}

/// ALIE's z: s = floor(n/2 + 1) - f peers must be won over; z = Φ⁻¹((n - s) / n).
fn alie_z() -> f32 {
    let s = N / 2 + 1 - LIARS;
    let p = (N - s) as f64 / N as f64;
    // Φ⁻¹ by bisection on the error function (p is between 0.5 and 1 here).
    let phi = |x: f64| 0.5 * (1.0 + libm_erf(x / std::f64::consts::SQRT_2));
    let (mut lo, mut hi) = (-10.0f64, 10.0f64);
    for _ in 0..100 {
        let mid = (lo + hi) / 2.0;
        if phi(mid) < p {
            lo = mid
        } else {
            hi = mid
        }
    }
    lo as f32
}

/// erf by Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7).
fn libm_erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
    let y = 1.0
        - (((((1.061_405_429 * t - 1.453_152_027) * t) + 1.421_413_741) * t - 0.284_496_736) * t
            + 0.254_829_592)
            * t
            * (-x * x).exp();
    if x >= 0.0 {
        y
    } else {
        -y
    }
}

/// One N(0, 1) sample (Box-Muller).
fn standard_normal(rng: &mut impl Rng) -> f32 {
    let u: f32 = rng.gen_range(f32::EPSILON..1.0);
    let v: f32 = rng.gen_range(0.0..1.0);
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f32::consts::PI * v).cos()
}

/// Peer `p`'s samples for batch `k` of epoch `e`: its shard (every N-th training sample).
fn batch(data: &Data, p: usize, e: usize, k: usize) -> Vec<usize> {
    let shard: Vec<usize> = (p..data.len()).step_by(N).collect();
    let start = (e * BATCHES_PER_EPOCH + k) * BATCH;
    (0..BATCH)
        .map(|j| shard[(start + j) % shard.len()])
        .collect()
}

/// Trains `EPOCHS` global steps with `aggregation`, the last `LIARS` peers attacking; returns
/// honest peer 0's test accuracy (NaN parameters count as 0) and whether every honest peer ended
/// with the same parameters.
async fn train(
    train: &Data,
    test: &Data,
    run: &str,
    aggregation: Aggregation,
    attack: Attack,
) -> (f64, bool) {
    let cluster = LocalCluster::start(N, NodeConfig::default()).await.unwrap();
    let nodes = cluster.nodes.clone();
    let runs = nodes.iter().enumerate().map(|(p, node)| async move {
        let liar = attack != Attack::None && p >= N - LIARS;
        let mut params = model();
        let opt = Sgd::new(sgd(), params.len()).unwrap();
        let mut cfg = collab_cfg(run, Mode::Gradients);
        cfg.target_batch_size = (N * BATCHES_PER_EPOCH * BATCH) as u64;
        cfg.progress.target_batch_size = cfg.target_batch_size;
        cfg.averager.target_group_size = N;
        cfg.averager.aggregation = aggregation;
        cfg.state_averaging_every = None;
        let mut collab = CollaborativeOptimizer::new(node.clone(), Box::new(opt), &params, cfg)
            .await
            .unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(p as u64);
        for e in 0..EPOCHS {
            let values = params.params().to_vec();
            // A liar running "a little is enough" estimates the honest mean and spread from
            // its own batches of the epoch.
            let grads_of = |k: usize| {
                let mut g = vec![0.0f32; values.len()];
                gradient(&values, train, &batch(train, p, e, k), &mut g);
                g
            };
            let own: Vec<Vec<f32>> = (0..BATCHES_PER_EPOCH).map(grads_of).collect();
            let mean: Vec<f32> = (0..values.len())
                .map(|j| own.iter().map(|g| g[j]).sum::<f32>() / own.len() as f32)
                .collect();
            let std: Vec<f32> = (0..values.len())
                .map(|j| {
                    let v = own.iter().map(|g| (g[j] - mean[j]).powi(2)).sum::<f32>()
                        / own.len() as f32;
                    v.sqrt()
                })
                .collect();
            for g in own.iter().take(BATCHES_PER_EPOCH) {
                let sent: Vec<f32> = match (liar, attack) {
                    (false, _) | (_, Attack::None) => g.clone(),
                    (true, Attack::Scale) => g.iter().map(|x| 100.0 * x).collect(),
                    (true, Attack::SignFlip) => g.iter().map(|x| -x).collect(),
                    (true, Attack::Noise) => {
                        let norm = g.iter().map(|x| x * x).sum::<f32>().sqrt();
                        let sd = 100.0 * norm / (g.len() as f32).sqrt();
                        (0..g.len())
                            .map(|_| sd * standard_normal(&mut rng))
                            .collect()
                    }
                    (true, Attack::ALittle) => {
                        let z = alie_z();
                        mean.iter().zip(&std).map(|(m, s)| m - z * s).collect()
                    }
                };
                params.grads_mut().copy_from_slice(&sent);
                collab.step(&mut params, BATCH as u64).await.unwrap();
            }
            let mut r = collab.try_step(&mut params).await.unwrap();
            while !r.stepped {
                tokio::time::sleep(Duration::from_millis(10)).await;
                r = collab.try_step(&mut params).await.unwrap();
            }
            assert_eq!(
                r.group_size,
                Some(N),
                "peer {p} epoch {e}: {:?}",
                r.averaging_error
            );
        }
        params.params().to_vec()
    });
    let finals = futures::future::join_all(runs).await;
    cluster.shutdown().await;
    let honest = &finals[..N - LIARS];
    let same = honest.iter().all(|p| p == &honest[0]);
    let acc = if honest[0].iter().all(|v| v.is_finite()) {
        accuracy(&honest[0], test)
    } else {
        0.0
    };
    (acc, same)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noise_breaks_the_mean_and_no_attack_gets_through_centered_clipping() {
    init_tracing();
    bounded(Duration::from_secs(300), async {
        let (tr, te) = digits();
        let clip: Aggregation = "centered-clip".parse().unwrap();
        let (clean, same) = train(&tr, &te, "byz-clean", Aggregation::Mean, Attack::None).await;
        assert!(same && clean > 0.85, "attack-free run: {clean}");
        let (attacked_mean, same) =
            train(&tr, &te, "byz-mean", Aggregation::Mean, Attack::Noise).await;
        assert!(same);
        assert!(
            attacked_mean < clean - 0.2,
            "the mean resisted noise of 100x the gradient norm: {attacked_mean} vs {clean}"
        );
        for attack in [Attack::Noise, Attack::Scale] {
            let (acc, same) = train(&tr, &te, &format!("byz-clip-{attack:?}"), clip, attack).await;
            assert!(
                same,
                "{attack:?}: honest peers ended apart under centered clipping"
            );
            assert!(
                acc > clean - 0.02,
                "{attack:?} got through centered clipping: {acc} vs {clean}"
            );
        }
    })
    .await;
}

/// Attack x aggregator -> honest peers' final test accuracy (one run each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, printed as a table"]
async fn attacks_by_aggregators_table() {
    init_tracing();
    let (tr, te) = digits();
    let aggregations: Vec<Aggregation> = ["mean", "median", "trimmed-mean", "centered-clip"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    println!("alie z = {:.3}", alie_z());
    println!(
        "| attack | {} |",
        aggregations
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(" | ")
    );
    for (i, attack) in [
        Attack::None,
        Attack::Scale,
        Attack::SignFlip,
        Attack::Noise,
        Attack::ALittle,
    ]
    .into_iter()
    .enumerate()
    {
        let mut row = Vec::new();
        for (j, a) in aggregations.iter().enumerate() {
            let (acc, same) = train(&tr, &te, &format!("byz-table-{i}-{j}"), *a, attack).await;
            row.push(format!("{acc:.3}{}", if same { "" } else { " (apart)" }));
        }
        println!("| {attack:?} | {} |", row.join(" | "));
    }
}
