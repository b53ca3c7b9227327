//! The arithmetic of one exchange, with no I/O: how far each side moves, and the measures the
//! tests and benchmarks use (weighted mean, consensus distance).
//!
//! In an exchange between an initiator `a` (values `x_a`, weight `w_a`) and a responder `b`,
//! the responder computes the difference `d = x_b - x̂_a` (`x̂_a`: what it decoded of `a`'s
//! values), encodes it, and **decodes its own encoding** into `d̂`, exactly what `a` will decode.
//! Then `a` adds `c_a d̂` and `b` subtracts `c_b d̂`, with `c_a = alpha w_b / (w_a + w_b)` and
//! `c_b = alpha w_a / (w_a + w_b)`, so the weighted sum `w_a x_a + w_b x_b` moves by
//! `(w_a c_a - w_b c_b) d̂ = 0`: the pair's mass is preserved whatever the codec lost, up to
//! float rounding. With the exact codec and `alpha = 1` both end on the pair's weighted mean.

/// How far each side of an exchange moves along the decoded difference `d̂ = x_b - x̂_a`:
/// the initiator adds `initiator * d̂`, the responder subtracts `responder * d̂`. `None` when
/// both weights are zero (nothing to average) or the inputs are not finite.
pub(crate) fn coefficients(alpha: f64, w_initiator: f64, w_responder: f64) -> Option<(f32, f32)> {
    let total = w_initiator + w_responder;
    let ok = alpha.is_finite()
        && alpha > 0.0
        && alpha <= 1.0
        && w_initiator.is_finite()
        && w_responder.is_finite()
        && w_initiator >= 0.0
        && w_responder >= 0.0
        && total > 0.0;
    ok.then(|| {
        (
            (alpha * w_responder / total) as f32,
            (alpha * w_initiator / total) as f32,
        )
    })
}

/// `values += c * d` (element by element).
pub(crate) fn add_scaled(values: &mut [f32], d: &[f32], c: f32) {
    values.iter_mut().zip(d).for_each(|(v, d)| *v += c * d);
}

/// `x_hat_a <- x_b - x_hat_a`: the responder's difference, in place.
pub(crate) fn difference_in_place(x_hat_a: &mut [f32], x_b: &[f32]) {
    x_hat_a.iter_mut().zip(x_b).for_each(|(a, b)| *a = b - *a);
}

/// The weighted mean of peers' vectors (in f64): `sum_i w_i x_i / sum_i w_i`. All vectors must
/// have the same length; an empty or weightless set gives an empty vector.
///
/// ```
/// use starling_averager::gossip::weighted_mean;
/// let m = weighted_mean(&[&[1.0, 2.0], &[3.0, 6.0]], &[1.0, 3.0]);
/// assert_eq!(m, vec![2.5, 5.0]);
/// ```
pub fn weighted_mean(vectors: &[&[f32]], weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    let Some(first) = vectors.first() else {
        return Vec::new();
    };
    if total <= 0.0 {
        return Vec::new();
    }
    let mut mean = vec![0.0f64; first.len()];
    for (v, w) in vectors.iter().zip(weights) {
        assert_eq!(v.len(), mean.len(), "vectors of different lengths");
        mean.iter_mut()
            .zip(v.iter())
            .for_each(|(m, x)| *m += w * f64::from(*x));
    }
    mean.iter_mut().for_each(|m| *m /= total);
    mean
}

/// Consensus distance: the mean over peers of the squared distance to the weighted mean, per
/// element, `(1 / n) sum_i ||x_i - mean||^2 / len` (in f64). Zero when every peer holds the
/// mean.
///
/// ```
/// use starling_averager::gossip::consensus_distance;
/// assert_eq!(consensus_distance(&[&[1.0], &[3.0]], &[1.0, 1.0]), 1.0);
/// assert_eq!(consensus_distance(&[&[2.0], &[2.0]], &[1.0, 5.0]), 0.0);
/// ```
pub fn consensus_distance(vectors: &[&[f32]], weights: &[f64]) -> f64 {
    let mean = weighted_mean(vectors, weights);
    if mean.is_empty() {
        return 0.0;
    }
    let sum: f64 = vectors
        .iter()
        .map(|v| {
            v.iter()
                .zip(&mean)
                .map(|(x, m)| (f64::from(*x) - m).powi(2))
                .sum::<f64>()
        })
        .sum();
    sum / (vectors.len() * mean.len()) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use starling_compression::{split_chunks, Codec, DecodeOptions, Decoder, EncodeOptions};

    /// What the wire does to a vector under `codec`: encode in chunks, decode.
    fn through(codec: Codec, x: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; x.len()];
        let mut chunks = split_chunks(codec, x, 4096, &EncodeOptions::default()).unwrap();
        let mut dec = Decoder::new(DecodeOptions::default());
        let mut buf = Vec::new();
        while let Some(h) = chunks.next_into(&mut buf) {
            let h = h.unwrap();
            let at = h.offset as usize;
            dec.decode_into(&buf, &mut out[at..at + h.count]).unwrap();
        }
        out
    }

    /// One exchange as the protocol runs it, without the network.
    fn exchange(codec: Codec, alpha: f64, a: &mut (Vec<f32>, f64), b: &mut (Vec<f32>, f64)) {
        let (ca, cb) = coefficients(alpha, a.1, b.1).unwrap();
        let mut d = through(codec, &a.0);
        difference_in_place(&mut d, &b.0);
        let d_hat = through(codec, &d);
        add_scaled(&mut a.0, &d_hat, ca);
        add_scaled(&mut b.0, &d_hat, -cb);
    }

    #[test]
    fn random_exchanges_preserve_the_weighted_mean_with_every_codec() {
        for codec in ["none", "f16", "u8", "u4"] {
            let codec: Codec = codec.parse().unwrap();
            let mut rng = rand::rngs::StdRng::seed_from_u64(3);
            let n = 12;
            let len = 3000;
            let mut peers: Vec<(Vec<f32>, f64)> = (0..n)
                .map(|_| {
                    let v = (0..len).map(|_| rng.gen_range(-1.0f32..3.0)).collect();
                    (v, rng.gen_range(0.5..4.0))
                })
                .collect();
            let view = |p: &[(Vec<f32>, f64)]| {
                let v: Vec<&[f32]> = p.iter().map(|(x, _)| &x[..]).collect();
                let w: Vec<f64> = p.iter().map(|(_, w)| *w).collect();
                (weighted_mean(&v, &w), consensus_distance(&v, &w))
            };
            let (m0, d0) = view(&peers);
            for _ in 0..400 {
                let i = rng.gen_range(0..n);
                let j = (i + rng.gen_range(1..n)) % n;
                let alpha = rng.gen_range(0.3..=1.0);
                let (lo, hi) = (i.min(j), i.max(j));
                let (left, right) = peers.split_at_mut(hi);
                let (a, b) = (&mut left[lo], &mut right[0]);
                if i < j {
                    exchange(codec, alpha, a, b)
                } else {
                    exchange(codec, alpha, b, a)
                }
            }
            let (m1, d1) = view(&peers);
            let err = m0
                .iter()
                .zip(&m1)
                .map(|(a, b)| (a - b).powi(2))
                .sum::<f64>()
                .sqrt()
                / m0.iter().map(|a| a * a).sum::<f64>().sqrt();
            assert!(err < 1e-5, "{codec}: mean moved by {err:e} (relative)");
            assert!(d1 < d0 * 1e-2, "{codec}: consensus {d0} -> {d1}");
        }
    }

    #[test]
    fn coefficients_balance_the_mass() {
        let (ca, cb) = coefficients(1.0, 1.0, 3.0).unwrap();
        assert_eq!((ca, cb), (0.75, 0.25));
        let (ca, cb) = coefficients(0.5, 2.0, 2.0).unwrap();
        assert_eq!((ca, cb), (0.25, 0.25));
        // A weightless initiator moves all the way; the responder stays.
        assert_eq!(coefficients(1.0, 0.0, 2.0), Some((1.0, 0.0)));
        assert_eq!(coefficients(1.0, 0.0, 0.0), None);
        assert_eq!(coefficients(1.5, 1.0, 1.0), None);
        assert_eq!(coefficients(1.0, f64::NAN, 1.0), None);
        assert_eq!(coefficients(1.0, -1.0, 2.0), None);
    }
}
