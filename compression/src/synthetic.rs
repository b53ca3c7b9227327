//! Deterministic synthetic tensors for tests and benchmarks: normal, Laplace and Student-t samples from a seeded
//! generator (Box-Muller for normals, inverse CDF for Laplace, `Z / sqrt(chi2/ν)` for Student-t).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// `n` samples of N(0, 1).
///
/// ```
/// let x = starling_compression::synthetic::normal(1000, 7);
/// assert_eq!(x, starling_compression::synthetic::normal(1000, 7));
/// ```
pub fn normal(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let (a, b) = box_muller(&mut rng);
        out.push(a as f32);
        out.push(b as f32);
    }
    out.truncate(n);
    out
}

/// `n` samples of a Laplace distribution with scale 1 (variance 2): heavier tails than normal.
pub fn laplace(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let u: f64 = rng.gen::<f64>() - 0.5;
            let v = -u.signum() * (1.0 - 2.0 * u.abs()).max(f64::MIN_POSITIVE).ln();
            v as f32
        })
        .collect()
}

/// `n` samples of Student's t with `dof` degrees of freedom (finite variance needs `dof > 2`; kurtosis is
/// infinite up to `dof = 4`).
pub fn student_t(n: usize, dof: u32, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let dof = dof.max(1);
    (0..n)
        .map(|_| {
            let (z, _) = box_muller(&mut rng);
            let chi2: f64 = (0..dof).map(|_| box_muller(&mut rng).0.powi(2)).sum();
            (z / (chi2 / f64::from(dof)).sqrt().max(1e-300)) as f32
        })
        .collect()
}

fn box_muller(rng: &mut StdRng) -> (f64, f64) {
    let u1: f64 = 1.0 - rng.gen::<f64>(); // (0, 1]
    let u2: f64 = rng.gen::<f64>();
    let r = (-2.0 * u1.ln()).sqrt();
    let t = std::f64::consts::TAU * u2;
    (r * t.cos(), r * t.sin())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moments(x: &[f32]) -> (f64, f64) {
        let n = x.len() as f64;
        let m = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let v = x.iter().map(|&v| (f64::from(v) - m).powi(2)).sum::<f64>() / n;
        (m, v)
    }

    #[test]
    fn distributions_have_their_moments() {
        let (m, v) = moments(&normal(100_000, 1));
        assert!(m.abs() < 0.02 && (v - 1.0).abs() < 0.03, "normal {m} {v}");
        let (m, v) = moments(&laplace(100_000, 2));
        assert!(m.abs() < 0.02 && (v - 2.0).abs() < 0.1, "laplace {m} {v}");
        let (m, v) = moments(&student_t(100_000, 5, 3));
        assert!(m.abs() < 0.03 && (v - 5.0 / 3.0).abs() < 0.2, "t5 {m} {v}");
        assert_eq!(normal(7, 9).len(), 7);
    }
}
