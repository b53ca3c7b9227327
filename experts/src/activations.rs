//! Forward activations an expert remembers between a request's forward and its backward.
//!
//! A client that trains through an expert calls forward, computes its loss, then calls
//! backward with the same inputs. Without memory the backward recomputes `x W1ᵀ + b1`, one of
//! the six matrix products a sample costs (hivemind recomputes the whole forward). The expert
//! keeps each forward part's (one request's) hidden pre-activation, keyed by its inputs, and a
//! backward whose inputs match a remembered part byte for byte uses it instead.
//!
//! Reuse is exact while the expert has not stepped since the forward. When other clients'
//! backwards stepped it in between, the remembered activations are those of the weights the
//! client's forward actually ran with: the gradients are then delayed by those steps, the same
//! order of staleness as recomputing with the new weights an output computed with the old ones
//! (what every asynchronous expert does). [`ActivationReuse::max_stale_steps`] bounds it; `0`
//! reuses only when nothing stepped.
//!
//! Memory is bounded by [`ActivationReuse::max_bytes`]: the oldest parts are dropped first, and
//! a backward consumes what it used.

use std::collections::{HashMap, VecDeque};

/// How an expert reuses forward activations in its backward.
///
/// ```
/// use starling_experts::ActivationReuse;
/// let exact = ActivationReuse { max_stale_steps: 0, ..ActivationReuse::default() };
/// assert_eq!(ActivationReuse::off().max_bytes, 0);
/// assert!(exact.max_bytes > 0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationReuse {
    /// Bytes of remembered activations (and their inputs, kept to match exactly); `0` turns
    /// reuse off.
    pub max_bytes: usize,
    /// Optimizer steps allowed between a part's forward and its backward for its activations to
    /// be reused; older parts are recomputed with the current weights.
    pub max_stale_steps: u64,
}

impl Default for ActivationReuse {
    /// 128 MiB (16 requests of 256 samples at width 1024 and inner width 4096), and parts at
    /// most 32 steps old.
    fn default() -> Self {
        ActivationReuse {
            max_bytes: 128 << 20,
            max_stale_steps: 32,
        }
    }
}

impl ActivationReuse {
    /// No reuse: every backward recomputes.
    pub fn off() -> Self {
        ActivationReuse {
            max_bytes: 0,
            max_stale_steps: 0,
        }
    }
}

/// One remembered part.
struct Entry {
    seq: u64,
    /// The expert's step count when the forward ran.
    step: u64,
    input: Vec<f32>,
    pre: Vec<f32>,
}

impl Entry {
    fn bytes(&self) -> usize {
        4 * (self.input.len() + self.pre.len())
    }
}

/// Remembered parts, by a fingerprint of their inputs, oldest dropped first.
pub(crate) struct ActivationCache {
    reuse: ActivationReuse,
    bytes: usize,
    /// Entries held.
    live: usize,
    seq: u64,
    entries: HashMap<u64, Vec<Entry>>,
    /// `(fingerprint, seq)` in insertion order; items whose entry was taken are skipped.
    order: VecDeque<(u64, u64)>,
}

/// A cheap key for an input: its length and up to 64 evenly spaced values. Equal inputs have
/// equal fingerprints; a match is then confirmed on every value.
fn fingerprint(input: &[f32]) -> u64 {
    const FNV_PRIME: u64 = 0x100_0000_01b3;
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ input.len() as u64;
    let stride = (input.len() / 64).max(1);
    for v in input.iter().step_by(stride) {
        h = (h ^ u64::from(v.to_bits())).wrapping_mul(FNV_PRIME);
    }
    h
}

impl ActivationCache {
    pub(crate) fn new(reuse: ActivationReuse) -> Self {
        ActivationCache {
            reuse,
            bytes: 0,
            live: 0,
            seq: 0,
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    pub(crate) fn reuse(&self) -> ActivationReuse {
        self.reuse
    }

    /// Whether forwards should keep their activations at all.
    pub(crate) fn enabled(&self) -> bool {
        self.reuse.max_bytes > 0
    }

    /// Bytes held now.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Forgets everything (the weights were replaced).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
        self.bytes = 0;
        self.live = 0;
    }

    /// The entry inserted as `seq` under `fp`, if still held.
    fn find(&self, fp: u64, seq: u64) -> Option<&Entry> {
        self.entries.get(&fp)?.iter().find(|e| e.seq == seq)
    }

    /// Drops the oldest entry; false when there is none.
    fn drop_oldest(&mut self) -> bool {
        while let Some((fp, seq)) = self.order.pop_front() {
            if let Some(bucket) = self.entries.get_mut(&fp) {
                if let Some(i) = bucket.iter().position(|e| e.seq == seq) {
                    let e = bucket.swap_remove(i);
                    self.bytes -= e.bytes();
                    self.live -= 1;
                    if bucket.is_empty() {
                        self.entries.remove(&fp);
                    }
                    return true;
                }
            }
        }
        false
    }

    /// Remembers the pre-activation `pre` of the part with inputs `input`, computed at optimizer
    /// step `step`. Parts too stale to be reused and, beyond the byte bound, the oldest parts
    /// are dropped; a part larger than the bound is not kept.
    pub(crate) fn insert(&mut self, input: Vec<f32>, pre: Vec<f32>, step: u64) {
        let entry = Entry {
            seq: self.seq,
            step,
            input,
            pre,
        };
        let size = entry.bytes();
        if size > self.reuse.max_bytes {
            return;
        }
        self.seq += 1;
        // Entries are in step order: drop those no backward may use any more, and the
        // places of parts already taken.
        while let Some(&(fp, seq)) = self.order.front() {
            let front = self.find(fp, seq).map(|e| e.step);
            match front {
                None => {
                    self.order.pop_front();
                }
                Some(s) if step.saturating_sub(s) > self.reuse.max_stale_steps => {
                    self.drop_oldest();
                }
                Some(_) => break,
            }
        }
        // Places of taken parts behind a live one: compact before they outgrow the parts.
        if self.order.len() > 4 * self.live + 64 {
            let entries = &self.entries;
            self.order.retain(|&(fp, seq)| {
                entries
                    .get(&fp)
                    .is_some_and(|b| b.iter().any(|e| e.seq == seq))
            });
        }
        while self.bytes + size > self.reuse.max_bytes && self.drop_oldest() {}
        let fp = fingerprint(&entry.input);
        self.order.push_back((fp, entry.seq));
        self.bytes += size;
        self.live += 1;
        self.entries.entry(fp).or_default().push(entry);
    }

    /// Takes the remembered pre-activation of a part with exactly these inputs, if one is at
    /// most `max_stale_steps` older than `step` (the oldest such, when a client sent the same
    /// inputs twice).
    pub(crate) fn take(&mut self, input: &[f32], step: u64) -> Option<Vec<f32>> {
        let fp = fingerprint(input);
        let bucket = self.entries.get_mut(&fp)?;
        let max = self.reuse.max_stale_steps;
        let i = bucket
            .iter()
            .enumerate()
            .filter(|(_, e)| e.input == input && step.saturating_sub(e.step) <= max)
            .min_by_key(|(_, e)| e.seq)
            .map(|(i, _)| i)?;
        let e = bucket.swap_remove(i);
        if bucket.is_empty() {
            self.entries.remove(&fp);
        }
        self.bytes -= e.bytes();
        self.live -= 1;
        Some(e.pre)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(seed: u32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32 * 31 + seed) % 97) as f32)
            .collect()
    }

    #[test]
    fn a_part_is_taken_once_and_only_with_identical_inputs() {
        let mut c = ActivationCache::new(ActivationReuse::default());
        c.insert(part(1, 100), vec![1.0; 400], 0);
        let mut other = part(1, 100);
        other[50] += 1.0; // same fingerprint unless sampled; must not match either way
        assert!(c.take(&other, 0).is_none());
        assert_eq!(c.take(&part(1, 100), 0), Some(vec![1.0; 400]));
        assert!(c.take(&part(1, 100), 0).is_none(), "consumed");
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn stale_parts_are_not_reused_and_are_dropped() {
        let reuse = ActivationReuse {
            max_stale_steps: 2,
            ..ActivationReuse::default()
        };
        let mut c = ActivationCache::new(reuse);
        c.insert(part(1, 10), vec![1.0; 40], 0);
        c.insert(part(2, 10), vec![2.0; 40], 0);
        assert!(c.take(&part(1, 10), 3).is_none(), "3 steps old");
        assert_eq!(c.take(&part(2, 10), 2), Some(vec![2.0; 40]));
        c.insert(part(3, 10), vec![3.0; 40], 1);
        c.insert(part(4, 10), vec![4.0; 40], 5);
        // Inserting at step 5 dropped the part from step 1 (and the stale one from step 0).
        assert_eq!(c.bytes(), 4 * 50);
        assert_eq!(c.take(&part(4, 10), 5), Some(vec![4.0; 40]));
    }

    #[test]
    fn the_byte_bound_drops_the_oldest_first() {
        let reuse = ActivationReuse {
            max_bytes: 4 * 50 * 3,
            max_stale_steps: 100,
        };
        let mut c = ActivationCache::new(reuse);
        for i in 0..5 {
            c.insert(part(i, 10), vec![i as f32; 40], 0);
            assert!(c.bytes() <= reuse.max_bytes);
        }
        assert!(c.take(&part(0, 10), 0).is_none());
        assert!(c.take(&part(1, 10), 0).is_none());
        for i in 2..5 {
            assert_eq!(c.take(&part(i, 10), 0), Some(vec![i as f32; 40]));
        }
        // Too large for the bound: not kept.
        c.insert(part(9, 1000), vec![0.0; 4000], 0);
        assert_eq!(c.bytes(), 0);
        let mut off = ActivationCache::new(ActivationReuse::off());
        off.insert(part(1, 10), vec![1.0; 40], 0);
        assert!(!off.enabled() && off.take(&part(1, 10), 0).is_none());
    }

    #[test]
    fn identical_inputs_twice_are_two_parts_taken_oldest_first() {
        let mut c = ActivationCache::new(ActivationReuse::default());
        c.insert(part(1, 10), vec![1.0; 40], 0);
        c.insert(part(1, 10), vec![2.0; 40], 1);
        assert_eq!(c.take(&part(1, 10), 1), Some(vec![1.0; 40]));
        assert_eq!(c.take(&part(1, 10), 1), Some(vec![2.0; 40]));
        c.clear();
        assert_eq!(c.bytes(), 0);
    }
}
