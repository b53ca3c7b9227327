//! Load balancing: which part of the flattened vector each member reduces.
//!
//! Cost model: upload is the scarce resource (volunteers' links are asymmetric) and `b` is each
//! member's measured upload rate. For a vector of `L` elements and `s` senders, a `Node` member
//! with span fraction `f` uploads `(1 - f) L` of its own data to the other reducers and then
//! `f L (s - 1)` of averaged deltas back, so its time is `L (1 + f (s - 2)) / b`; an `Aux`
//! member (weight 0, sends nothing of its own) takes `L f s / b`; a `Client` takes `L / b`
//! whatever happens. [`solve_fractions`] minimises the slowest member's time subject to
//! `sum f = 1` by bisection on that time; members whose bandwidth is too low to help get no span.
//!
//! Not modelled yet: download limits. On a *symmetric* slow link a member moves about
//! `(s - 1) / s` of the vector each way in each phase whatever its span, so there the equal share
//! is the best split and shrinking the slow member's span does not help.

use std::ops::Range;

use crate::config::AveragingMode;

/// Span fractions (summing to 1) that minimise the slowest member's transfer time. Returns
/// `None` when no member can reduce (all clients).
///
/// ```
/// use starling_averager::{partition::solve_fractions, AveragingMode::*};
/// // Equal peers share equally.
/// let f = solve_fractions(&[1e8, 1e8, 1e8, 1e8], &[Node, Node, Node, Node]).unwrap();
/// assert!(f.iter().all(|x| (x - 0.25).abs() < 1e-6));
/// // A peer with a tenth of the bandwidth gets a much smaller span (here: none).
/// let f = solve_fractions(&[1e8, 1e8, 1e8, 1e7], &[Node, Node, Node, Node]).unwrap();
/// assert!(f[3] < 0.05 && (f.iter().sum::<f64>() - 1.0).abs() < 1e-9);
/// ```
pub fn solve_fractions(bandwidths: &[f64], modes: &[AveragingMode]) -> Option<Vec<f64>> {
    assert_eq!(bandwidths.len(), modes.len());
    let senders = modes.iter().filter(|m| **m != AveragingMode::Aux).count() as f64;
    // (base, slope) of each member's time per unit of bandwidth: t_i = (base + slope f_i) / b_i.
    let model: Vec<Option<(f64, f64)>> = modes
        .iter()
        .map(|m| match m {
            AveragingMode::Node => Some((1.0, senders - 2.0)),
            AveragingMode::Aux => Some((0.0, senders)),
            AveragingMode::Client => None,
        })
        .collect();
    if model.iter().all(|m| m.is_none()) {
        return None;
    }
    let bw: Vec<f64> = bandwidths
        .iter()
        .map(|b| if b.is_finite() && *b > 0.0 { *b } else { 1.0 })
        .collect();
    // Largest fraction member i can take within time t.
    let cap = |i: usize, t: f64| -> f64 {
        match model[i] {
            None => 0.0,
            Some((base, slope)) => {
                let room = t * bw[i] - base;
                if room < 0.0 {
                    0.0
                } else if slope <= 1e-12 {
                    1.0
                } else {
                    (room / slope).min(1.0)
                }
            }
        }
    };
    let total = |t: f64| (0..bw.len()).map(|i| cap(i, t)).sum::<f64>();
    // No split finishes before every sender has moved its own data once: time L / b for nodes
    // and clients. Below that floor, extra room costs nothing, so solve from the floor up.
    let floor = (0..bw.len())
        .filter(|&i| modes[i] != AveragingMode::Aux)
        .map(|i| 1.0 / bw[i])
        .fold(0.0, f64::max);
    let mut hi = floor.max(f64::MIN_POSITIVE);
    while total(hi) < 1.0 {
        hi *= 2.0;
        if !hi.is_finite() {
            return None;
        }
    }
    let mut lo = floor;
    if total(lo) >= 1.0 {
        hi = lo;
    }
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if total(mid) >= 1.0 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let mut f: Vec<f64> = (0..bw.len()).map(|i| cap(i, hi)).collect();
    // With zero-slope members (two senders) capacity is all-or-nothing: share by bandwidth.
    let sum: f64 = f.iter().sum();
    if sum > 1.0 + 1e-9 && model.iter().flatten().any(|(_, s)| *s <= 1e-12) {
        for (i, x) in f.iter_mut().enumerate() {
            if *x > 0.0 {
                *x = bw[i];
            }
        }
    }
    let sum: f64 = f.iter().sum();
    Some(f.into_iter().map(|x| x / sum).collect())
}

/// How far (in octaves, log2) a measured rate may stray from the group's median before the
/// solve acts on it. Rates are measured on live transfers and swing from round to round (CPU
/// scheduling, other traffic, socket buffers, the order in which reducers start returning
/// results: the largest over the smallest of four peers' estimates on identical links measured
/// 1.2-1.9x at 500 Mbit/s and up to 3.75x at 100 Mbit/s, so each within about 1.9x of the
/// median); [`solve_fractions`] is sensitive to small differences (at 4 peers a 1.5x faster
/// peer gets 3x the span), so acting on noise makes one peer the round's bottleneck, and on
/// symmetric links any uneven split is slower than equal spans. The price: a peer within 2.8x
/// of the median is treated as equal.
pub const NOISE_OCTAVES: f64 = 1.5;

/// The bandwidths the solve should act on: each rate's ratio to the group's median is shrunk by
/// [`NOISE_OCTAVES`] on a log scale (a soft threshold), so rates within 2.8x of the median
/// count as equal while a genuinely slow peer stays slow (20x slower is still 7x slower).
/// Continuous in the inputs; non-positive or non-finite rates are left as they are.
///
/// ```
/// use starling_averager::partition::denoise_bandwidths;
/// let d = denoise_bandwidths(&[1.0e8, 1.8e8, 0.6e8, 1.2e8]);
/// assert!(d.iter().all(|b| (b / d[0] - 1.0).abs() < 1e-9)); // noise: all equal
/// let d = denoise_bandwidths(&[1.0e8, 1.0e8, 1.0e8, 0.5e7]);
/// assert!(d[0] / d[3] > 7.0); // a throttled peer stays far slower
/// ```
pub fn denoise_bandwidths(bandwidths: &[f64]) -> Vec<f64> {
    let valid = bandwidths
        .iter()
        .copied()
        .filter(|b| b.is_finite() && *b > 0.0);
    let Some(median) = geometric_median(valid) else {
        return bandwidths.to_vec();
    };
    bandwidths
        .iter()
        .map(|&b| {
            if !(b.is_finite() && b > 0.0) {
                return b;
            }
            let octaves = (b / median).log2();
            let shrunk = octaves.signum() * (octaves.abs() - NOISE_OCTAVES).max(0.0);
            median * shrunk.exp2()
        })
        .collect()
}

/// The median of positive rates; for an even count, the geometric mean of the two middle ones
/// (rates compare by ratio). `None` when there are none.
pub(crate) fn geometric_median(rates: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = rates.collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some((v[(n - 1) / 2] * v[n / 2]).sqrt())
}

/// Contiguous spans of `total` elements, one per member in order, sized by `fractions`
/// (largest-remainder rounding, so sizes sum exactly to `total`).
///
/// ```
/// use starling_averager::partition::spans;
/// assert_eq!(spans(10, &[0.5, 0.0, 0.5]), vec![0..5, 5..5, 5..10]);
/// ```
pub fn spans(total: usize, fractions: &[f64]) -> Vec<Range<usize>> {
    let exact: Vec<f64> = fractions.iter().map(|f| f * total as f64).collect();
    let mut sizes: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
    let mut left = total.saturating_sub(sizes.iter().sum());
    let mut order: Vec<usize> = (0..sizes.len()).filter(|&i| fractions[i] > 0.0).collect();
    order.sort_by(|&a, &b| {
        (exact[b] - exact[b].floor())
            .total_cmp(&(exact[a] - exact[a].floor()))
            .then(a.cmp(&b))
    });
    let mut k = 0;
    while left > 0 && !order.is_empty() {
        sizes[order[k % order.len()]] += 1;
        left -= 1;
        k += 1;
    }
    let mut start = 0;
    sizes
        .into_iter()
        .map(|n| {
            let r = start..start + n;
            start += n;
            r
        })
        .collect()
}

/// [`spans`] laid out from member `first` on (then `first + 1`, ..., wrapping around):
/// `result[i]` is still member `i`'s span and the sizes are those of `fractions`, but which
/// member holds the start of the vector moves with `first`. A round lays its spans out from an
/// offset taken from its id, so that no member reduces the same part of the vector in every
/// round of a group that re-forms with the same members in the same order: a reducer whose
/// results are lost, or one that lies, lands on other parameters from one round to the next
/// (a lie that always landed on the last layer's weights, whose uniform shift a softmax does
/// not see, passed for harmless).
///
/// ```
/// use starling_averager::partition::rotated_spans;
/// assert_eq!(rotated_spans(10, &[0.5, 0.0, 0.5], 0), vec![0..5, 5..5, 5..10]);
/// assert_eq!(rotated_spans(10, &[0.5, 0.0, 0.5], 2), vec![5..10, 10..10, 0..5]);
/// ```
pub fn rotated_spans(total: usize, fractions: &[f64], first: usize) -> Vec<Range<usize>> {
    let n = fractions.len();
    if n == 0 {
        return Vec::new();
    }
    let first = first % n;
    let order: Vec<f64> = (0..n).map(|k| fractions[(first + k) % n]).collect();
    let mut out = vec![0..0; n];
    for (k, r) in spans(total, &order).into_iter().enumerate() {
        out[(first + k) % n] = r;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AveragingMode::*;
    use proptest::prelude::*;

    fn max_time(bw: &[f64], modes: &[AveragingMode], f: &[f64]) -> f64 {
        let s = modes.iter().filter(|m| **m != Aux).count() as f64;
        (0..bw.len())
            .map(|i| match modes[i] {
                Node => (1.0 - f[i] + f[i] * (s - 1.0)) / bw[i],
                Aux => f[i] * s / bw[i],
                Client => 1.0 / bw[i],
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn rotated_spans_tile_the_vector_with_each_members_share() {
        let fractions = [0.1, 0.0, 0.3, 0.6];
        for first in 0..9 {
            let r = rotated_spans(1001, &fractions, first);
            assert_eq!(r.len(), 4);
            // Every element in exactly one span, the spans contiguous in rotated order.
            let mut sorted = r.clone();
            sorted.sort_by_key(|s| (s.start, s.end));
            let mut at = 0;
            for s in &sorted {
                assert_eq!(s.start, at, "first {first}: {r:?}");
                at = s.end;
            }
            assert_eq!(at, 1001);
            // Sizes within one element of the exact share, and none for a zero fraction.
            for (s, f) in r.iter().zip(fractions) {
                assert!((s.len() as f64 - f * 1001.0).abs() < 1.0, "{r:?}");
            }
            assert!(r[1].is_empty());
            // The vector starts with member `first` (or the next member with a share).
            let head = (0..4)
                .map(|k| (first + k) % 4)
                .find(|&m| fractions[m] > 0.0);
            assert_eq!(r[head.unwrap()].start, 0, "first {first}: {r:?}");
        }
        assert_eq!(rotated_spans(5, &[], 3), Vec::<Range<usize>>::new());
    }

    #[test]
    fn noisy_equal_peers_share_equally_and_slow_peers_still_get_little() {
        let modes = [Node, Node, Node, Node];
        for noisy in [
            [1.0, 1.3, 0.8, 1.2],
            [1.4, 1.0, 0.75, 1.0],
            [1.0, 1.0, 1.0, 1.39],
            [1.0, 1.9, 1.0, 0.6],
            [1.0, 1.9, 1.0, 0.51],
        ] {
            let bw: Vec<f64> = noisy.iter().map(|x| x * 1e8).collect();
            let f = solve_fractions(&denoise_bandwidths(&bw), &modes).unwrap();
            assert!(
                f.iter().all(|x| (x - 0.25).abs() < 1e-6),
                "{noisy:?} -> {f:?}"
            );
        }
        let f = solve_fractions(&denoise_bandwidths(&[1e8, 1e8, 1e8, 0.5e7]), &modes).unwrap();
        assert!(f[3] < 0.05, "{f:?}");
        // Continuous across the dead band's edge.
        let at = |r: f64| denoise_bandwidths(&[1.0, 1.0, r])[2];
        let edge = 2f64.powf(NOISE_OCTAVES);
        assert!((at(edge * 1.0001) - at(edge * 0.9999)).abs() < 1e-3);
        assert_eq!(denoise_bandwidths(&[0.0, f64::NAN, 5.0])[2], 5.0);
    }

    #[test]
    fn clients_reduce_nothing_and_all_clients_is_none() {
        let f = solve_fractions(&[1e8, 1e9, 1e8], &[Node, Client, Node]).unwrap();
        assert_eq!(f[1], 0.0);
        assert!((f[0] - 0.5).abs() < 1e-6);
        assert!(solve_fractions(&[1e8, 1e8], &[Client, Client]).is_none());
    }

    #[test]
    fn two_peers_share_by_bandwidth() {
        let f = solve_fractions(&[3e8, 1e8], &[Node, Node]).unwrap();
        assert!((f[0] - 0.75).abs() < 1e-9, "{f:?}");
    }

    #[test]
    fn aux_takes_load_from_slow_nodes() {
        let f = solve_fractions(&[1e7, 1e7, 1e9], &[Node, Node, Aux]).unwrap();
        assert!(f[2] > 0.9, "{f:?}");
    }

    proptest! {
        #[test]
        fn solution_is_valid_and_no_worse_than_equal_split(
            bw in proptest::collection::vec(1e6f64..1e10, 2..12),
            client_mask in any::<u16>(),
        ) {
            let mut modes: Vec<AveragingMode> = (0..bw.len())
                .map(|i| if client_mask >> i & 1 == 1 { Client } else { Node })
                .collect();
            modes[0] = Node;
            let f = solve_fractions(&bw, &modes).unwrap();
            prop_assert!((f.iter().sum::<f64>() - 1.0).abs() < 1e-9);
            prop_assert!(f.iter().all(|x| *x >= 0.0));
            for i in 0..f.len() {
                if modes[i] == Client { prop_assert_eq!(f[i], 0.0); }
            }
            let reducers = modes.iter().filter(|m| **m == Node).count() as f64;
            let equal: Vec<f64> = modes.iter().map(|m| if *m == Node { 1.0 / reducers } else { 0.0 }).collect();
            prop_assert!(max_time(&bw, &modes, &f) <= max_time(&bw, &modes, &equal) * (1.0 + 1e-6));
            let total = 1_000_003usize;
            let sp = spans(total, &f);
            prop_assert_eq!(sp.last().unwrap().end, total);
            for w in sp.windows(2) { prop_assert_eq!(w[0].end, w[1].start); }
        }
    }
}
