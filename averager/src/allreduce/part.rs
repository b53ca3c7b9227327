//! The arithmetic of a reduction with no I/O ([`PartReducer`]): parts, weighted means, deltas
//! and contributor runs, unit-tested without sockets.

use std::ops::Range;
use std::sync::Arc;

use super::Segment;
use crate::wire::MemberIdx;
use crate::Aggregation;

/// One contribution to a part: whose it is, its weight, and its values of the part.
pub(crate) struct Input<'a> {
    pub member: MemberIdx,
    pub weight: f64,
    pub values: &'a [f32],
}

/// The arithmetic of one reduction, with no I/O: the job's range cut into parts (one chunk's
/// worth of elements each), which part is due next, each part's weighted mean, and the runs of
/// parts with the same contributors (what the reports and `Result` messages say).
pub(crate) struct PartReducer {
    /// Absolute start of the range in the flattened vector.
    start: usize,
    len: usize,
    part_len: usize,
    /// Index of the next part to reduce.
    next: usize,
    segments: Vec<Segment>,
    aggregation: Aggregation,
}

impl PartReducer {
    /// A reduction of `range`, in parts of `part_len` elements (at least 1).
    pub fn new(range: Range<usize>, part_len: usize) -> Self {
        PartReducer {
            start: range.start,
            len: range.len(),
            part_len: part_len.max(1),
            next: 0,
            segments: Vec::new(),
            aggregation: Aggregation::Mean,
        }
    }

    /// Combines each part's inputs by `aggregation` instead of the weighted mean.
    pub fn with_aggregation(mut self, aggregation: Aggregation) -> Self {
        self.aggregation = aggregation;
        self
    }

    /// Whether every part has been reduced (or skipped).
    pub fn is_done(&self) -> bool {
        self.next * self.part_len >= self.len
    }

    /// Whether no part has been reduced yet.
    pub fn is_first(&self) -> bool {
        self.next == 0
    }

    /// The next part (offsets within the range), if any is left.
    pub fn next_part(&self) -> Option<Range<usize>> {
        let s = self.next * self.part_len;
        (s < self.len).then(|| s..(s + self.part_len).min(self.len))
    }

    /// The next part, if every present sender's data reaches its end (`prefixes`: how much of
    /// the range each present sender has delivered).
    pub fn ready(&self, mut prefixes: impl Iterator<Item = usize>) -> Option<Range<usize>> {
        self.next_part()
            .filter(|p| prefixes.all(|got| got >= p.end))
    }

    /// Writes the weighted mean (or the aggregate, see [`PartReducer::with_aggregation`]) of the
    /// next part's `inputs` into `mean` (the part's slice of the result) and moves on. Weights
    /// are normalised by their sum; if they sum to 0 every input counts equally. Returns the part (offsets within the range) and its sorted
    /// contributors, or `None` for the part when nobody contributed (it keeps local values).
    pub fn reduce_next(
        &mut self,
        mean: &mut [f32],
        inputs: &[Input<'_>],
    ) -> Option<(Range<usize>, Arc<Vec<MemberIdx>>)> {
        let part = self.next_part()?;
        self.next += 1;
        if inputs.is_empty() {
            return None;
        }
        debug_assert!(
            mean.len() == part.len() && inputs.iter().all(|i| i.values.len() == part.len())
        );
        let mut contributors: Vec<MemberIdx> = inputs.iter().map(|i| i.member).collect();
        contributors.sort_unstable();
        let pairs: Vec<(f64, &[f32])> = inputs.iter().map(|i| (i.weight, i.values)).collect();
        self.aggregation.aggregate(mean, &pairs);
        let abs = self.start + part.start..self.start + part.end;
        match self.segments.last_mut() {
            Some(last) if last.1 == contributors && last.0.end == abs.start => last.0.end = abs.end,
            _ => self.segments.push((abs, contributors.clone())),
        }
        Some((part, Arc::new(contributors)))
    }

    /// The reduced runs (absolute ranges) with their contributors, in order.
    pub fn into_segments(self) -> Vec<Segment> {
        self.segments
    }
}

/// A sender's delta: what it must add to the values it sent to land on the mean.
pub(crate) fn delta_into(delta: &mut [f32], mean: &[f32], received: &[f32]) {
    delta
        .iter_mut()
        .zip(mean.iter().zip(received))
        .for_each(|(d, (m, x))| *d = m - x);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-10.0f32..10.0)).collect()
    }

    #[test]
    fn parts_are_weighted_means_of_random_inputs() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (len, part_len) = (1000, 300);
        let data: Vec<Vec<f32>> = (0..3).map(|_| random(&mut rng, len)).collect();
        let weights = [1.0, 2.5, 0.5];
        let mut r = PartReducer::new(100..100 + len, part_len);
        let mut mean = vec![0.0f32; len];
        let mut parts = Vec::new();
        while let Some(part) = r.next_part() {
            let inputs: Vec<Input<'_>> = (0..3)
                .map(|i| Input {
                    member: MemberIdx::of(i),
                    weight: weights[i],
                    values: &data[i][part.clone()],
                })
                .collect();
            let (p, c) = r.reduce_next(&mut mean[part.clone()], &inputs).unwrap();
            assert_eq!(p, part);
            assert_eq!(*c, vec![MemberIdx(0), MemberIdx(1), MemberIdx(2)]);
            parts.push(p);
        }
        assert!(r.is_done());
        assert_eq!(parts, vec![0..300, 300..600, 600..900, 900..1000]);
        // Against the exact mean in f64: relative error below 1e-6 of the values' scale.
        let total: f64 = weights.iter().sum();
        for (e, m) in mean.iter().enumerate() {
            let exact: f64 = (0..3)
                .map(|i| weights[i] * f64::from(data[i][e]))
                .sum::<f64>()
                / total;
            assert!(
                (f64::from(*m) - exact).abs() < 1e-6 * 10.0,
                "element {e}: {m} vs {exact}"
            );
        }
        // One run with the same contributors, in absolute offsets.
        assert_eq!(
            r.into_segments(),
            vec![(100..1100, vec![MemberIdx(0), MemberIdx(1), MemberIdx(2)])]
        );
    }

    #[test]
    fn zero_weights_count_equally_and_deltas_land_on_the_mean() {
        let a = [1.0f32, 2.0];
        let b = [3.0f32, 6.0];
        let mut r = PartReducer::new(0..2, 8);
        let mut mean = [0.0f32; 2];
        let inputs = [
            Input {
                member: MemberIdx(3),
                weight: 0.0,
                values: &a,
            },
            Input {
                member: MemberIdx(1),
                weight: 0.0,
                values: &b,
            },
        ];
        let (_, c) = r.reduce_next(&mut mean, &inputs).unwrap();
        assert_eq!(mean, [2.0, 4.0]);
        assert_eq!(
            *c,
            vec![MemberIdx(1), MemberIdx(3)],
            "contributors are sorted"
        );
        let mut delta = [0.0f32; 2];
        delta_into(&mut delta, &mean, &a);
        assert_eq!([a[0] + delta[0], a[1] + delta[1]], mean);
    }

    #[test]
    fn ready_waits_for_every_sender_and_runs_split_on_contributor_changes() {
        let x = [1.0f32; 4];
        let mut r = PartReducer::new(10..18, 4);
        assert_eq!(
            r.ready([4usize, 3].into_iter()),
            None,
            "one sender is short of the part"
        );
        assert_eq!(r.ready([4usize, 8].into_iter()), Some(0..4));
        assert_eq!(
            r.ready(std::iter::empty()),
            Some(0..4),
            "no senders: only this peer's data"
        );
        let both = [
            Input {
                member: MemberIdx(0),
                weight: 1.0,
                values: &x,
            },
            Input {
                member: MemberIdx(2),
                weight: 1.0,
                values: &x,
            },
        ];
        let mut mean = [0.0f32; 4];
        r.reduce_next(&mut mean, &both).unwrap();
        // Nobody's data for the second part: it stays local and is not listed.
        assert!(r.reduce_next(&mut mean, &[]).is_none());
        assert!(r.is_done());
        assert_eq!(r.next_part(), None);
        assert_eq!(
            r.into_segments(),
            vec![(10..14, vec![MemberIdx(0), MemberIdx(2)])]
        );

        let mut r = PartReducer::new(0..6, 2);
        let one = [Input {
            member: MemberIdx(0),
            weight: 1.0,
            values: &x[..2],
        }];
        let two = [
            Input {
                member: MemberIdx(0),
                weight: 1.0,
                values: &x[..2],
            },
            Input {
                member: MemberIdx(1),
                weight: 1.0,
                values: &x[..2],
            },
        ];
        let mut mean = [0.0f32; 2];
        r.reduce_next(&mut mean, &two);
        r.reduce_next(&mut mean, &two);
        r.reduce_next(&mut mean, &one);
        assert_eq!(
            r.into_segments(),
            vec![
                (0..4, vec![MemberIdx(0), MemberIdx(1)]),
                (4..6, vec![MemberIdx(0)])
            ]
        );
    }
}
