//! The digits task shared by `training_collaborative.rs` and `gossip.rs`: data, softmax model,
//! gradient, accuracy, per-peer batches. Four peers, batches of 16.
#![allow(dead_code)]

use std::time::Duration;

use rand::{seq::SliceRandom, Rng, SeedableRng};
use starling_training::{CollaborativeConfig, Mode, ParamSet, SgdConfig};

pub const PEERS: usize = 4;
pub const FEATURES: usize = 64;
pub const CLASSES: usize = 10;
pub const BATCH: usize = 16;
/// Batches each peer contributes to one global step.
pub const BATCHES_PER_EPOCH: usize = 4;

pub struct Data {
    pub x: Vec<f32>,
    pub y: Vec<usize>,
}

impl Data {
    pub fn len(&self) -> usize {
        self.y.len()
    }
}

/// The digits (1797 8x8 images), scaled to [0, 1], split 80/20 with a fixed shuffle.
pub fn digits() -> (Data, Data) {
    let d = smartcore::dataset::digits::load_dataset();
    let mut order: Vec<usize> = (0..d.num_samples).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));
    let split = d.num_samples * 4 / 5;
    let take = |idx: &[usize]| Data {
        x: idx
            .iter()
            .flat_map(|&i| {
                d.data[i * FEATURES..(i + 1) * FEATURES]
                    .iter()
                    .map(|v| v / 16.0)
            })
            .collect(),
        y: idx.iter().map(|&i| d.target[i] as usize).collect(),
    };
    (take(&order[..split]), take(&order[split..]))
}

/// A softmax classifier `logits = W x + b` as flat buffers, seeded small random weights.
pub fn model() -> ParamSet {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let w: Vec<f32> = (0..CLASSES * FEATURES)
        .map(|_| rng.gen_range(-0.05f32..0.05))
        .collect();
    let b: Vec<f32> = (0..CLASSES)
        .map(|_| rng.gen_range(-0.05f32..0.05))
        .collect();
    let mut p = ParamSet::new();
    p.add("w", &[CLASSES, FEATURES], &w).unwrap();
    p.add("b", &[CLASSES], &b).unwrap();
    p
}

pub fn logits(params: &[f32], x: &[f32]) -> [f32; CLASSES] {
    let (w, b) = params.split_at(CLASSES * FEATURES);
    let mut out = [0f32; CLASSES];
    for (c, o) in out.iter_mut().enumerate() {
        *o = b[c]
            + w[c * FEATURES..(c + 1) * FEATURES]
                .iter()
                .zip(x)
                .map(|(w, x)| w * x)
                .sum::<f32>();
    }
    out
}

/// The mean cross-entropy gradient over the samples `idx`, written into `grads`.
pub fn gradient(params: &[f32], data: &Data, idx: &[usize], grads: &mut [f32]) {
    grads.fill(0.0);
    let (gw, gb) = grads.split_at_mut(CLASSES * FEATURES);
    for &i in idx {
        let x = &data.x[i * FEATURES..(i + 1) * FEATURES];
        let z = logits(params, x);
        let max = z.iter().cloned().fold(f32::MIN, f32::max);
        let e: Vec<f32> = z.iter().map(|v| (v - max).exp()).collect();
        let sum: f32 = e.iter().sum();
        for c in 0..CLASSES {
            let d = e[c] / sum - if c == data.y[i] { 1.0 } else { 0.0 };
            gb[c] += d;
            for (g, xv) in gw[c * FEATURES..(c + 1) * FEATURES].iter_mut().zip(x) {
                *g += d * xv;
            }
        }
    }
    let k = 1.0 / idx.len() as f32;
    grads.iter_mut().for_each(|g| *g *= k);
}

pub fn accuracy(params: &[f32], data: &Data) -> f64 {
    let right = (0..data.len())
        .filter(|&i| {
            let z = logits(params, &data.x[i * FEATURES..(i + 1) * FEATURES]);
            let best = (0..CLASSES).max_by(|a, b| z[*a].total_cmp(&z[*b])).unwrap();
            best == data.y[i]
        })
        .count();
    right as f64 / data.len() as f64
}

/// Peer `p`'s samples for batch `k` of epoch `e`: its shard (every PEERS-th training sample),
/// taken in order, wrapping around.
pub fn batch(data: &Data, p: usize, e: usize, k: usize) -> Vec<usize> {
    let shard: Vec<usize> = (p..data.len()).step_by(PEERS).collect();
    let start = (e * BATCHES_PER_EPOCH + k) * BATCH;
    (0..BATCH)
        .map(|j| shard[(start + j) % shard.len()])
        .collect()
}

pub fn sgd() -> SgdConfig {
    SgdConfig::new(0.5).momentum(0.9)
}

pub fn collab_cfg(run: &str, mode: Mode) -> CollaborativeConfig {
    let mut cfg = CollaborativeConfig::new(run, (PEERS * BATCHES_PER_EPOCH * BATCH) as u64, mode);
    cfg.averager.target_group_size = PEERS;
    cfg.fetch_interval = Duration::from_millis(20);
    cfg.averaging_timeout = Duration::from_secs(20);
    // Each peer computes exactly its share, then waits with try_step (the single-peer
    // baselines use the same samples).
    cfg.projected_batch = false;
    if matches!(mode, Mode::LocalSgd { .. }) {
        // A DiLoCo round that begins without a member leaves that peer apart (what the fault
        // tests cover, not these): a member held up past the default half-second grace (4
        // peers and a second test on 2 cores, a stalled DHT write) split one of 8 rounds of the
        // compressed-rounds table in a CI run, and one held 1 s at batch 35 does every time.
        // The leaders wait longer; a full group still begins at once, so this costs nothing
        // when all four come.
        cfg.averager.start_grace = Some(Duration::from_secs(3));
    }
    cfg
}
