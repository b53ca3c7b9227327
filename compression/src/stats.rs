//! Statistics the codecs need: finiteness checks, mean and standard deviation (exact or from a sample), and a
//! deterministic sample of positions.

use crate::error::{Error, Result};

/// Inputs up to this many elements get exact statistics; larger ones are estimated from a sample of
/// [`STATS_SAMPLE_ELEMENTS`] positions (Uniform8Bit and Uniform4Bit only need a range, and their codebooks of bin
/// means keep the decoded mean exact whatever range is chosen).
pub(crate) const EXACT_STATS_MAX_ELEMENTS: usize = 1 << 16;

/// Elements sampled to estimate mean and standard deviation of large inputs.
pub(crate) const STATS_SAMPLE_ELEMENTS: usize = 1 << 14;

const EXP_MASK: u32 = 0x7f80_0000;

/// Whether `x` holds a NaN or an infinity. Branch-free so it vectorizes; callers run it on L1-sized blocks.
#[inline]
pub(crate) fn has_nonfinite(x: &[f32]) -> bool {
    let mut acc = 0u32;
    for v in x {
        acc |= u32::from(v.to_bits() & EXP_MASK == EXP_MASK);
    }
    acc != 0
}

/// Errors with the first non-finite element of `x` (whose first element has index `base` in the input).
#[inline]
pub(crate) fn check_finite(x: &[f32], base: usize) -> Result<()> {
    if has_nonfinite(x) {
        let i = x.iter().position(|v| !v.is_finite()).unwrap_or(0);
        return Err(Error::NonFiniteInput {
            index: base + i,
            value: x[i],
        });
    }
    Ok(())
}

/// Mean and (population) standard deviation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Moments {
    pub mean: f64,
    pub std: f64,
}

/// Exact mean and standard deviation in one pass: sums of `x - shift` (shift = mean of the first few values, which
/// keeps cancellation small) in eight f32 lanes per block of 1024, blocks accumulated in f64. Inputs so extreme
/// that f32 differences overflow are redone in f64.
pub(crate) fn exact_moments(x: &[f32]) -> Moments {
    if x.is_empty() {
        return Moments {
            mean: 0.0,
            std: 0.0,
        };
    }
    let head = &x[..x.len().min(64)];
    let shift = (head.iter().map(|&v| f64::from(v)).sum::<f64>() / head.len() as f64) as f32;
    let (mut s, mut q) = (0f64, 0f64);
    for block in x.chunks(1024) {
        let mut ls = [0f32; 8];
        let mut lq = [0f32; 8];
        let mut lanes = block.chunks_exact(8);
        for c in &mut lanes {
            for j in 0..8 {
                let d = c[j] - shift;
                ls[j] += d;
                lq[j] += d * d;
            }
        }
        for &v in lanes.remainder() {
            let d = v - shift;
            ls[0] += d;
            lq[0] += d * d;
        }
        s += ls.iter().map(|&v| f64::from(v)).sum::<f64>();
        q += lq.iter().map(|&v| f64::from(v)).sum::<f64>();
    }
    let m = finish(f64::from(shift), s, q, x.len());
    if m.mean.is_finite() && m.std.is_finite() {
        return m;
    }
    let shift = f64::from(shift);
    let (s, q) = x.iter().fold((0f64, 0f64), |(s, q), &v| {
        let d = f64::from(v) - shift;
        (s + d, q + d * d)
    });
    finish(shift, s, q, x.len())
}

fn finish(shift: f64, s: f64, q: f64, n: usize) -> Moments {
    let n = n as f64;
    let m = s / n;
    Moments {
        mean: shift + m,
        std: (q / n - m * m).max(0.0).sqrt(),
    }
}

/// Mean and standard deviation: exact for small inputs, else estimated from [`STATS_SAMPLE_ELEMENTS`] sampled
/// positions (falling back to exact when the sample sees no spread, as with very sparse data).
pub(crate) fn estimated_moments(x: &[f32]) -> Moments {
    if x.len() <= EXACT_STATS_MAX_ELEMENTS {
        return exact_moments(x);
    }
    let shift = x[0];
    let (mut s, mut q) = (0f64, 0f64);
    for i in sample_positions(x.len(), STATS_SAMPLE_ELEMENTS) {
        let d = f64::from(x[i]) - f64::from(shift);
        s += d;
        q += d * d;
    }
    let m = finish(f64::from(shift), s, q, STATS_SAMPLE_ELEMENTS);
    if m.std > 0.0 {
        m
    } else {
        exact_moments(x)
    }
}

/// `count` positions spread over `0..n`: one per stride, jittered by a hash so that periodic structure (rows of a
/// flattened matrix) cannot alias with the stride. Deterministic, so encoding is reproducible.
pub(crate) fn sample_positions(n: usize, count: usize) -> impl Iterator<Item = usize> {
    let stride = (n / count.max(1)).max(1);
    let count = count.min(n);
    (0..count).map(move |i| i * stride + (splitmix64(i as u64) % stride as u64) as usize)
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Replaces NaN and ±Inf by 0.0 (the documented treatment of non-finite input by statistical codecs).
pub(crate) fn sanitized(x: &[f32]) -> Vec<f32> {
    x.iter()
        .map(|&v| if v.is_finite() { v } else { 0.0 })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finite_checks() {
        let mut x = vec![1.0f32; 5000];
        assert!(!has_nonfinite(&x));
        assert!(check_finite(&x, 0).is_ok());
        x[4321] = f32::NEG_INFINITY;
        assert!(has_nonfinite(&x));
        assert!(matches!(
            check_finite(&x, 10),
            Err(Error::NonFiniteInput { index: 4331, .. })
        ));
        x[4321] = f32::NAN;
        assert!(has_nonfinite(&x));
        assert!(!has_nonfinite(&[
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            0.0,
            -0.0,
            1e-45
        ]));
    }

    #[test]
    fn moments_match_f64() {
        let x: Vec<f32> = (0..10_007)
            .map(|i| 1000.0 + ((i * 7919) % 1000) as f32 * 0.01)
            .collect();
        let n = x.len() as f64;
        let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = x
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        let m = exact_moments(&x);
        assert!((m.mean - mean).abs() < 1e-4, "{} vs {mean}", m.mean);
        assert!(
            (m.std - var.sqrt()).abs() < 1e-4 * var.sqrt(),
            "{} vs {}",
            m.std,
            var.sqrt()
        );
        assert_eq!(
            exact_moments(&[3.5]),
            Moments {
                mean: 3.5,
                std: 0.0
            }
        );
        assert_eq!(
            exact_moments(&[]),
            Moments {
                mean: 0.0,
                std: 0.0
            }
        );
    }

    #[test]
    fn sampled_moments_see_sparse_spread() {
        let mut x = vec![0f32; 1 << 20];
        x[12345] = 1.0;
        let m = estimated_moments(&x);
        assert!(m.std > 0.0);
    }

    #[test]
    fn sample_positions_in_range() {
        for n in [1usize, 7, 100, 16_384, 16_385, 1 << 20] {
            let p: Vec<usize> = sample_positions(n, STATS_SAMPLE_ELEMENTS).collect();
            assert_eq!(p.len(), n.min(STATS_SAMPLE_ELEMENTS));
            assert!(p.iter().all(|&i| i < n));
            assert!(p.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
