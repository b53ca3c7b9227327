//! Where a peer's batches come from: its own random stream ([`Sampler`]), or its
//! [`Shard`] of the run's shared batch order ([`SharedOrder`]), which lets a swarm's run be
//! compared batch for batch with one peer's.

use anyhow::{ensure, Context, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::data::Dataset;
use crate::model::{images_batch, text_batch, Batch};

/// Draws batches from a dataset's training part.
pub struct Sampler {
    rng: StdRng,
    batch: usize,
}

impl Sampler {
    /// Batches of `batch` samples, drawn with `seed`.
    pub fn new(batch: usize, seed: u64) -> Self {
        Sampler {
            rng: StdRng::seed_from_u64(seed),
            batch,
        }
    }

    /// The next batch (samples drawn uniformly with replacement; text: random windows).
    pub fn next(&mut self, data: &Dataset, context: usize) -> Result<Batch> {
        let idx = draw(&mut self.rng, self.batch, data, context);
        batch_of(data, &idx, context)
    }
}

/// `batch` sample indices (images) or window starts (text), uniformly with replacement.
fn draw(rng: &mut StdRng, batch: usize, data: &Dataset, context: usize) -> Vec<usize> {
    let n = match data {
        Dataset::Images(d) => d.train_len(),
        Dataset::Text(t) => t.train.len() - context,
    };
    (0..batch).map(|_| rng.gen_range(0..n)).collect()
}

fn batch_of(data: &Dataset, idx: &[usize], context: usize) -> Result<Batch> {
    match data {
        Dataset::Images(d) => images_batch(d, idx, false),
        Dataset::Text(t) => text_batch(&t.train, idx, context),
    }
}

/// A peer's share of a run's batches: every `count`-th batch of the run's shared order,
/// starting at the `index`-th (`0/1`: all of them).
///
/// ```
/// use starling_run::batches::Shard;
/// let s: Shard = "1/2".parse().unwrap();
/// assert_eq!((s.index, s.count), (1, 2));
/// assert!("2/2".parse::<Shard>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// Which of the `count` shares (from 0).
    pub index: u32,
    /// How many shares the order is dealt into.
    pub count: u32,
}

impl std::str::FromStr for Shard {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let (i, n) = s
            .split_once('/')
            .with_context(|| format!("a shard is INDEX/COUNT (e.g. 0/2), not {s:?}"))?;
        let index: u32 = i
            .trim()
            .parse()
            .with_context(|| format!("shard index {i:?}"))?;
        let count: u32 = n
            .trim()
            .parse()
            .with_context(|| format!("shard count {n:?}"))?;
        ensure!(
            count >= 1 && index < count,
            "shard {index}/{count}: the index must be below the count (0/{count} to {}/{count})",
            count.max(1) - 1
        );
        Ok(Shard { index, count })
    }
}

/// The run's shared batch order, dealt out by [`Shard`]: the batches of epoch `e` are one
/// stream drawn from the run's seed and `e`, the same on every peer, and a peer takes its
/// shard's batches of the epoch it is in, in turn. So `count` peers with shards `0..count`
/// that each compute `k` batches of an epoch draw, together, the first `count * k` batches one
/// peer with shard `0/1` draws alone: a swarm's run can be compared batch for batch with one
/// peer's. (Without it each peer draws its own random batches, [`Sampler`].)
///
/// ```
/// use starling_run::batches::{Shard, SharedOrder};
/// let order = SharedOrder::new(32, 7, "0/2".parse::<Shard>().unwrap());
/// ```
pub struct SharedOrder {
    batch: usize,
    seed: u64,
    shard: Shard,
    /// The epoch whose stream `rng` is.
    epoch: Option<u64>,
    /// Batches of that stream to pass over (other shards' turns) before this shard's next.
    skip: u32,
    rng: StdRng,
}

impl SharedOrder {
    /// Batches of `batch` samples from the order of `run_seed`, this peer's `shard` of it.
    pub fn new(batch: usize, run_seed: u64, shard: Shard) -> Self {
        SharedOrder {
            batch,
            seed: run_seed,
            shard,
            epoch: None,
            skip: 0,
            rng: StdRng::seed_from_u64(0),
        }
    }

    /// This shard's next batch of `epoch` (the first of it when the epoch is new here).
    pub fn next(&mut self, epoch: u64, data: &Dataset, context: usize) -> Result<Batch> {
        if self.epoch != Some(epoch) {
            // A stream per epoch: a peer that joins late, or computed more batches of an
            // epoch than its share, is back in step at the next one.
            let key = self.seed ^ 0x5348_4152_4544_u64 ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            self.rng = StdRng::seed_from_u64(key);
            self.epoch = Some(epoch);
            self.skip = self.shard.index;
        }
        for _ in 0..self.skip {
            draw(&mut self.rng, self.batch, data, context);
        }
        let idx = draw(&mut self.rng, self.batch, data, context);
        self.skip = self.shard.count.saturating_sub(1);
        batch_of(data, &idx, context)
    }
}

/// Where a peer's batches come from.
pub enum Batches {
    /// Its own random stream.
    Own(Sampler),
    /// Its shard of the run's shared order.
    Shared(SharedOrder),
}

impl Batches {
    /// The next batch, for a peer in `epoch`.
    pub fn next(&mut self, epoch: u64, data: &Dataset, context: usize) -> Result<Batch> {
        match self {
            Batches::Own(s) => s.next(data, context),
            Batches::Shared(s) => s.next(epoch, data, context),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Text;

    /// Shards 0/3, 1/3 and 2/3 of an epoch together draw exactly the batches shard 0/1 draws
    /// alone, in turn; each epoch has its own stream; a shard that moves to a new epoch starts
    /// at that epoch's first batch of its share, however many of the last it drew.
    #[test]
    fn shards_of_the_shared_order_deal_out_one_peers_batches() {
        let data = Dataset::Text(Text {
            vocab: "abcde".chars().collect(),
            train: (0..600u32).map(|i| (i * 7 + i / 5) % 5).collect(),
            val: Vec::new(),
        });
        let rows = |b: Batch| -> Vec<Vec<u32>> { b.x.to_vec2::<u32>().unwrap() };
        let mut alone = SharedOrder::new(4, 11, "0/1".parse().unwrap());
        let mut shards: Vec<SharedOrder> = (0..3)
            .map(|i| SharedOrder::new(4, 11, Shard { index: i, count: 3 }))
            .collect();
        for epoch in [0, 1, 5] {
            let lone: Vec<_> = (0..6)
                .map(|_| rows(alone.next(epoch, &data, 8).unwrap()))
                .collect();
            for (k, want) in lone.iter().enumerate() {
                let got = rows(shards[k % 3].next(epoch, &data, 8).unwrap());
                assert_eq!(&got, want, "epoch {epoch}, batch {k}");
            }
            // One shard draws past its share; at the next epoch it is back in step.
            shards[1].next(epoch, &data, 8).unwrap();
        }
        let e0 = rows(
            SharedOrder::new(4, 11, "0/1".parse().unwrap())
                .next(0, &data, 8)
                .unwrap(),
        );
        let e1 = rows(
            SharedOrder::new(4, 11, "0/1".parse().unwrap())
                .next(1, &data, 8)
                .unwrap(),
        );
        let other = rows(
            SharedOrder::new(4, 12, "0/1".parse().unwrap())
                .next(0, &data, 8)
                .unwrap(),
        );
        assert_ne!(e0, e1, "each epoch its own batches");
        assert_ne!(e0, other, "each run seed its own order");
        for bad in ["1/1", "0/0", "3", "a/2", "-1/2"] {
            assert!(bad.parse::<Shard>().is_err(), "{bad} parsed");
        }
    }
}
