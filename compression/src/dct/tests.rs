use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

#[test]
fn the_basis_is_orthonormal_and_matches_the_dct_formula() {
    for n in [2, 7, 64, 300] {
        let b = basis(n);
        for f in 0..n {
            for g in 0..n {
                let d: f64 = (0..n)
                    .map(|i| f64::from(b[f * n + i]) * f64::from(b[g * n + i]))
                    .sum();
                let want = if f == g { 1.0 } else { 0.0 };
                assert!((d - want).abs() < 1e-5, "n {n}: <{f}, {g}> = {d}");
            }
        }
        let x = random(n, n as u64);
        let mut c = vec![0.0; n];
        transform(&b, n, &x, &mut c);
        for (f, cf) in c.iter().enumerate() {
            let s = if f == 0 {
                (1.0 / n as f64).sqrt()
            } else {
                (2.0 / n as f64).sqrt()
            };
            let want: f64 = (0..n)
                .map(|i| {
                    f64::from(x[i])
                        * (std::f64::consts::PI * (i as f64 + 0.5) * f as f64 / n as f64).cos()
                })
                .sum::<f64>()
                * s;
            assert!((f64::from(*cf) - want).abs() < 1e-4, "n {n} f {f}");
        }
    }
}

/// The fast forward transform (rustdct) against the dense basis product and the f64 formula,
/// on the sizes it plans differently: powers of two, odd, prime, and the largest chunk.
#[test]
fn the_fast_forward_transform_matches_the_dense_one() {
    let mut planner = rustdct::DctPlanner::new();
    for n in [2, 7, 40, 64, 97, 256, 300, MAX_CHUNK] {
        let b = basis(n);
        let mut fast = Forward::new(&mut planner, n);
        for seed in 0..3 {
            let x = random(n, 100 * n as u64 + seed);
            let mut dense = vec![0.0; n];
            transform(&b, n, &x, &mut dense);
            let mut got = vec![0.0; n];
            fast.apply(&x, &mut got);
            assert!(rel(&got, &dense) < 1e-5, "n {n}: {}", rel(&got, &dense));
            // And the largest coefficient, against f64.
            let (f, _) = got
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap();
            let s = if f == 0 {
                1.0 / n as f64
            } else {
                2.0 / n as f64
            }
            .sqrt();
            let want = s
                * (0..n)
                    .map(|i| {
                        f64::from(x[i])
                            * (std::f64::consts::PI * (i as f64 + 0.5) * f as f64 / n as f64).cos()
                    })
                    .sum::<f64>();
            assert!(
                (f64::from(got[f]) - want).abs() < 1e-4 * want.abs().max(1.0),
                "n {n} f {f}"
            );
        }
    }
}

#[test]
fn keeping_every_coefficient_gives_the_gradient_back() {
    let g = random(1000, 1); // 15 chunks of 64 and a tail of 40
    let mut s = DctTopK::new(g.len(), 64, 64, DctValues::F32).unwrap();
    let mut c = vec![0.0; g.len()];
    s.begin(&g, &mut c).unwrap();
    let mut out = vec![0.0; g.len()];
    s.finish(&c, &mut out).unwrap();
    assert!(rel(&out, &g) < 1e-5, "{}", rel(&out, &g));
    assert!(s.residual().iter().all(|r| r.abs() < 1e-6));
}

#[test]
fn the_largest_coefficients_are_kept_k_per_chunk() {
    let len = 64 * 3 + 10;
    let g = random(len, 2);
    let mut s = DctTopK::new(len, 64, 5, DctValues::F32).unwrap();
    let mut c = vec![0.0; len];
    s.begin(&g, &mut c).unwrap();
    let mut planner = rustdct::DctPlanner::new();
    for (start, n) in s.chunks() {
        // The coefficients as `begin` computes them (the fast transform: the dense one agrees
        // to rounding, `the_fast_forward_transform_matches_the_dense_one`).
        let mut full = vec![0.0; n];
        Forward::new(&mut planner, n).apply(&g[start..start + n], &mut full);
        let kept: Vec<usize> = (0..n).filter(|&i| c[start + i] != 0.0).collect();
        assert_eq!(kept.len(), s.kept(n), "chunk at {start}");
        let smallest_kept = kept
            .iter()
            .map(|&i| full[i].abs())
            .fold(f32::INFINITY, f32::min);
        for i in (0..n).filter(|i| !kept.contains(i)) {
            assert!(
                full[i].abs() <= smallest_kept,
                "chunk at {start}: dropped a larger one"
            );
        }
        for &i in &kept {
            assert_eq!(c[start + i], full[i]);
        }
    }
    assert_eq!(s.kept(10), 1, "the tail keeps its share, at least one");
}

#[test]
fn error_feedback_sends_every_coefficient_eventually() {
    let len = 256;
    let mut s = DctTopK::new(len, 64, 2, DctValues::F16).unwrap();
    let b = basis(64);
    let mut sent = vec![0.0f64; len];
    let mut total = vec![0.0f64; len];
    for round in 0..40 {
        let g = random(len, 100 + round);
        for (start, n) in s.chunks() {
            let mut c = vec![0.0; n];
            transform(&b, n, &g[start..start + n], &mut c);
            for (t, v) in total[start..start + n].iter_mut().zip(&c) {
                *t += f64::from(*v);
            }
        }
        let mut c = vec![0.0; len];
        s.begin(&g, &mut c).unwrap();
        for (t, v) in sent.iter_mut().zip(&c) {
            *t += f64::from(*v);
        }
        let mut out = vec![0.0; len];
        s.finish(&c, &mut out).unwrap();
    }
    for ((s_, t), r) in sent.iter().zip(&total).zip(s.residual()) {
        assert!((s_ + f64::from(*r) - t).abs() < 1e-3, "{s_} + {r} != {t}");
    }
}

/// With a momentum `beta`, what was not sent is `beta` times the last residual plus this
/// round's transformed gradient, less what went out (DeMo's decoupled momentum), checked
/// against that recurrence in f64 over 30 rounds.
#[test]
fn a_momentum_decays_what_was_not_sent() {
    let len = 300;
    let beta = 0.9f32;
    let mut s = DctTopK::new(len, 64, 3, DctValues::F32)
        .unwrap()
        .momentum(beta)
        .unwrap();
    let b = basis(64);
    let tail = basis(len % 64);
    let mut momentum = vec![0.0f64; len];
    for round in 0..30 {
        let g = random(len, 500 + round);
        let mut c = vec![0.0; len];
        s.begin(&g, &mut c).unwrap();
        for (start, n) in s.chunks() {
            let mut coeffs = vec![0.0; n];
            let basis = if n == 64 { &b } else { &tail };
            transform(basis, n, &g[start..start + n], &mut coeffs);
            for (i, m) in momentum[start..start + n].iter_mut().enumerate() {
                *m = f64::from(beta) * *m + f64::from(coeffs[i]) - f64::from(c[start + i]);
            }
        }
        let mut out = vec![0.0; len];
        s.finish(&c, &mut out).unwrap();
        for (i, (m, r)) in momentum.iter().zip(s.residual()).enumerate() {
            assert!(
                (m - f64::from(*r)).abs() < 1e-4,
                "round {round} [{i}]: {m} vs {r}"
            );
        }
    }
    // Without the decay the sum would keep growing; with it the residual stays bounded.
    let norm: f64 = s
        .residual()
        .iter()
        .map(|r| f64::from(*r).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(norm < 10.0 * (len as f64).sqrt(), "{norm}");
    for bad in [0.0, -0.5, 1.01, f32::NAN] {
        assert!(DctTopK::new(len, 64, 3, DctValues::F32)
            .unwrap()
            .momentum(bad)
            .is_err());
    }
}

#[test]
fn sign_values_take_one_magnitude_and_f16_values_are_half_precision() {
    let g = random(640, 3);
    let mut s = DctTopK::new(g.len(), 64, 4, DctValues::Sign).unwrap();
    let mut c = vec![0.0; g.len()];
    s.begin(&g, &mut c).unwrap();
    let mags: Vec<f32> = c.iter().filter(|v| **v != 0.0).map(|v| v.abs()).collect();
    assert_eq!(mags.len(), 40);
    assert!(mags.iter().all(|m| *m == mags[0]));
    assert!(c.iter().any(|v| *v < 0.0) && c.iter().any(|v| *v > 0.0));
    let mut s = DctTopK::new(g.len(), 64, 4, DctValues::F16).unwrap();
    s.begin(&g, &mut c).unwrap();
    assert!(c.iter().all(|v| f16::from_f32(*v).to_f32() == *v));
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    assert!(DctTopK::new(100, 1, 1, DctValues::F32).is_err());
    assert!(DctTopK::new(100, 64, 0, DctValues::F32).is_err());
    assert!(DctTopK::new(100, 64, 65, DctValues::F32).is_err());
    assert!(DctTopK::new(100, MAX_CHUNK + 1, 1, DctValues::F32).is_err());
    let mut s = DctTopK::new(100, 16, 2, DctValues::F32).unwrap();
    let mut c = vec![0.0; 100];
    let mut out = vec![0.0; 100];
    assert!(s.finish(&c, &mut out).is_err(), "no round begun");
    let mut g = random(100, 4);
    g[50] = f32::INFINITY;
    assert!(matches!(
        s.begin(&g, &mut c),
        Err(Error::NonFiniteInput { index: 50, .. })
    ));
    g[50] = 0.1;
    assert!(s.begin(&g[..99], &mut c).is_err());
    s.begin(&g, &mut c).unwrap();
    let mut poisoned = c.clone();
    poisoned[3] = f32::NAN;
    assert!(s.finish(&poisoned, &mut out).is_err());
    s.abort();
    assert!(s.residual().iter().all(|&r| r == 0.0));
}
