use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// Weighted mean of equal-length vectors, in f32 with a fixed order (what the averager hands
/// every member with the exact codec).
fn mean(vs: &[Vec<f32>]) -> Vec<f32> {
    (0..vs[0].len())
        .map(|i| vs.iter().map(|v| v[i]).sum::<f32>() / vs.len() as f32)
        .collect()
}

/// One PowerSGD round over `peers` with an exact mean in between; returns each peer's result.
fn round(peers: &mut [PowerSgd], grads: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let one = peers[0].phase_one_len();
    let two = peers[0].phase_two_len();
    let firsts: Vec<Vec<f32>> = peers
        .iter_mut()
        .zip(grads)
        .map(|(p, g)| {
            let mut v = vec![0.0; one];
            p.begin(g, &mut v).unwrap();
            v
        })
        .collect();
    let mean_one = mean(&firsts);
    let mut averaged_ones = vec![mean_one; peers.len()];
    let seconds: Vec<Vec<f32>> = peers
        .iter_mut()
        .zip(&mut averaged_ones)
        .map(|(p, a)| {
            let mut v = vec![0.0; two];
            p.middle(a, &mut v).unwrap();
            v
        })
        .collect();
    let mean_two = mean(&seconds);
    peers
        .iter_mut()
        .zip(&averaged_ones)
        .zip(grads)
        .map(|((p, a), g)| {
            let mut out = g.clone();
            p.finish(a, &mean_two, &mut out).unwrap();
            out
        })
        .collect()
}

fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - y).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// A rows x cols matrix of rank `r` (sum of r random outer products) plus `noise`.
fn low_rank(rows: usize, cols: usize, r: usize, noise: f32, seed: u64) -> Vec<f32> {
    let u = random(rows * r, seed);
    let v = random(cols * r, seed + 1);
    let e = random(rows * cols, seed + 2);
    let mut m = vec![0.0f32; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            let s: f32 = (0..r).map(|k| u[k * rows + i] * v[k * cols + j]).sum();
            m[i * cols + j] = s + noise * e[i * cols + j];
        }
    }
    m
}

#[test]
fn kernels_match_a_plain_f64_reference() {
    let (rows, cols, rank) = (37, 23, 3);
    let m = random(rows * cols, 1);
    let q = random(cols * rank, 2);
    let mut p = vec![0.0; rows * rank];
    project(&m, rows, cols, &q, rank, &mut p);
    let mut q2 = vec![0.0; cols * rank];
    project_back(&m, rows, cols, &p, rank, &mut q2);
    let mut out = vec![0.0; rows * cols];
    reconstruct(&p, &q2, rows, cols, rank, &mut out);
    let m64 = |i: usize, j: usize| f64::from(m[i * cols + j]);
    let p_ref: Vec<f64> = (0..rank)
        .flat_map(|c| (0..rows).map(move |i| (c, i)))
        .map(|(c, i)| {
            (0..cols)
                .map(|j| m64(i, j) * f64::from(q[c * cols + j]))
                .sum()
        })
        .collect();
    assert!(rel_err(&p, &p_ref) < 1e-6);
    let q_ref: Vec<f64> = (0..rank)
        .flat_map(|c| (0..cols).map(move |j| (c, j)))
        .map(|(c, j)| {
            (0..rows)
                .map(|i| m64(i, j) * f64::from(p[c * rows + i]))
                .sum()
        })
        .collect();
    assert!(rel_err(&q2, &q_ref) < 1e-6);
    let out_ref: Vec<f64> = (0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            (0..rank)
                .map(|c| f64::from(p[c * rows + i]) * f64::from(q2[c * cols + j]))
                .sum()
        })
        .collect();
    assert!(rel_err(&out, &out_ref) < 1e-6);
}

#[test]
fn orthonormalization_holds_on_ill_conditioned_columns() {
    // Columns that differ by 1e-3 .. 1e-6 of their length: classical Gram-Schmidt in f32 loses
    // orthogonality here; two passes of modified Gram-Schmidt with f64 sums keep it.
    let (rows, rank) = (500, 5);
    let base = random(rows, 10);
    let mut p = Vec::new();
    for c in 0..rank {
        let d = random(rows, 20 + c as u64);
        let eps = 10f32.powi(-(c as i32) - 2);
        p.extend(base.iter().zip(&d).map(|(b, x)| b + eps * x));
    }
    let original = p.clone();
    orthonormalize(&mut p, rows, rank);
    for a in 0..rank {
        let ca = &p[a * rows..(a + 1) * rows];
        let na = dot64(ca, ca);
        assert!((na - 1.0).abs() < 1e-5, "column {a} has norm² {na}");
        for b in 0..a {
            let d = dot64(ca, &p[b * rows..(b + 1) * rows]);
            assert!(d.abs() < 1e-5, "columns {a} and {b}: dot {d}");
        }
    }
    // The span is kept: every original column is (almost) its projection on the basis.
    for c in 0..rank {
        let col = &original[c * rows..(c + 1) * rows];
        let mut rest: Vec<f64> = col.iter().map(|&v| f64::from(v)).collect();
        for b in 0..rank {
            let basis = &p[b * rows..(b + 1) * rows];
            let d = dot64(col, basis);
            for (r, y) in rest.iter_mut().zip(basis) {
                *r -= d * f64::from(*y);
            }
        }
        let left = rest.iter().map(|v| v * v).sum::<f64>().sqrt() / norm(col);
        assert!(left < 1e-5, "column {c}: {left} of it outside the basis");
    }
}

#[test]
fn dependent_and_zero_columns_become_zero_not_noise() {
    let rows = 64;
    let a = random(rows, 3);
    let mut p = a.clone();
    p.extend(a.iter().map(|v| 2.0 * v)); // dependent
    p.extend(std::iter::repeat_n(0.0, rows)); // zero
    orthonormalize(&mut p, rows, 3);
    assert!((dot64(&p[..rows], &p[..rows]) - 1.0).abs() < 1e-6);
    assert!(p[rows..].iter().all(|&v| v == 0.0));
}

#[test]
fn every_peer_gets_the_same_bits_and_the_reference_approximation() {
    let (rows, cols, rank) = (48, 40, 4);
    let len = rows * cols + 10 + 30; // a bias before, a small matrix after
    let layout = [
        LowRankMatrix {
            offset: 10,
            rows,
            cols,
        },
        LowRankMatrix {
            offset: 10 + rows * cols,
            rows: 5,
            cols: 6,
        },
    ];
    let mut peers: Vec<PowerSgd> = (0..3)
        .map(|_| PowerSgd::new(rank, len, &layout, 11).unwrap())
        .collect();
    assert_eq!(
        peers[0].compressed().len(),
        1,
        "the 5x6 matrix does not gain at rank 4"
    );
    assert_eq!(peers[0].phase_one_len(), rows * rank + 10 + 30);
    let grads: Vec<Vec<f32>> = (0..3).map(|p| random(len, 100 + p)).collect();
    let q0 = peers[0].q.clone();
    let out = round(&mut peers, &grads);
    assert_eq!(out[0], out[1]);
    assert_eq!(out[1], out[2]);
    // Reference in f64: M̄, P = M̄ Q0, orthonormal basis of P, approximation P Pᵀ M̄.
    let mbar: Vec<f64> = (0..len)
        .map(|i| grads.iter().map(|g| f64::from(g[i])).sum::<f64>() / 3.0)
        .collect();
    let m = |i: usize, j: usize| mbar[10 + i * cols + j];
    let mut basis: Vec<Vec<f64>> = Vec::new();
    for c in 0..rank {
        let mut col: Vec<f64> = (0..rows)
            .map(|i| {
                (0..cols)
                    .map(|j| m(i, j) * f64::from(q0[c * cols + j]))
                    .sum()
            })
            .collect();
        for _ in 0..2 {
            for b in &basis {
                let d: f64 = col.iter().zip(b).map(|(x, y)| x * y).sum();
                col.iter_mut().zip(b).for_each(|(x, y)| *x -= d * y);
            }
        }
        let n = col.iter().map(|x| x * x).sum::<f64>().sqrt();
        basis.push(col.into_iter().map(|x| x / n).collect());
    }
    let approx: Vec<f64> = (0..rows * cols)
        .map(|k| {
            let (i, j) = (k / cols, k % cols);
            basis
                .iter()
                .map(|b| b[i] * (0..rows).map(|l| b[l] * m(l, j)).sum::<f64>())
                .sum()
        })
        .collect();
    let got = &out[0][10..10 + rows * cols];
    assert!(rel_err(got, &approx) < 1e-4, "{}", rel_err(got, &approx));
    // The uncompressed parts are the exact mean.
    for i in (0..10).chain(10 + rows * cols..len) {
        assert!((f64::from(out[0][i]) - mbar[i]).abs() < 1e-6);
    }
}

#[test]
fn a_mean_of_lower_rank_is_recovered_in_one_round() {
    let (rows, cols) = (60, 50);
    let layout = [LowRankMatrix {
        offset: 0,
        rows,
        cols,
    }];
    let mut peers: Vec<PowerSgd> = (0..2)
        .map(|_| PowerSgd::new(4, rows * cols, &layout, 5).unwrap())
        .collect();
    // Both peers' gradients lie in the same 2-dimensional column space: so does the mean.
    let shared = low_rank(rows, cols, 2, 0.0, 40);
    let grads: Vec<Vec<f32>> = (0..2)
        .map(|p| shared.iter().map(|v| v * (1.0 + p as f32)).collect())
        .collect();
    let out = round(&mut peers, &grads);
    let want: Vec<f64> = shared.iter().map(|&v| 1.5 * f64::from(v)).collect();
    assert!(
        rel_err(&out[0], &want) < 1e-5,
        "{}",
        rel_err(&out[0], &want)
    );
    // Each residual is the peer's own gradient less the shared result (as in hivemind's and
    // PyTorch's PowerSGD); the mean's part of them is nothing.
    for i in 0..rows * cols {
        let mean_residual = (peers[0].residual()[i] + peers[1].residual()[i]) / 2.0;
        assert!(mean_residual.abs() < 1e-4);
    }
}

#[test]
fn a_direction_lost_to_a_rank_deficient_gradient_comes_back() {
    // A rank-1 gradient leaves three of four columns of P collinear: they are dropped, and
    // `Q`'s matching columns come back zero. From then on a rank-4 gradient must still be
    // approximated in rank 4 (a zero column of a raw warm start would stay zero for good).
    let (rows, cols) = (60, 50);
    let layout = [LowRankMatrix {
        offset: 0,
        rows,
        cols,
    }];
    let mut peer = PowerSgd::new(4, rows * cols, &layout, 3).unwrap();
    let flat = low_rank(rows, cols, 1, 0.0, 60);
    round(std::slice::from_mut(&mut peer), std::slice::from_ref(&flat));
    let zero_columns = (0..4)
        .filter(|c| peer.q[c * cols..(c + 1) * cols].iter().all(|&x| x == 0.0))
        .count();
    assert_eq!(zero_columns, 3, "the rank-1 round dropped three directions");
    let m = low_rank(rows, cols, 4, 0.0, 70);
    let want: Vec<f64> = m.iter().map(|&v| f64::from(v)).collect();
    let mut errors = Vec::new();
    for _ in 0..3 {
        peer.residual.fill(0.0);
        let out = round(std::slice::from_mut(&mut peer), std::slice::from_ref(&m));
        errors.push(rel_err(&out[0], &want));
    }
    assert!(errors[2] < 1e-3, "{errors:?}");
}

#[test]
fn warm_started_power_iteration_converges_on_a_fixed_gradient() {
    // Without error feedback's help (the residual is what it corrects, so compare the
    // approximation of a fixed matrix round after round): error falls to the noise floor.
    let (rows, cols) = (80, 64);
    let m = low_rank(rows, cols, 3, 0.01, 50);
    let layout = [LowRankMatrix {
        offset: 0,
        rows,
        cols,
    }];
    let mut peer = PowerSgd::new(3, rows * cols, &layout, 1).unwrap();
    let want: Vec<f64> = m.iter().map(|&v| f64::from(v)).collect();
    let mut errors = Vec::new();
    for _ in 0..6 {
        peer.residual.fill(0.0);
        let out = round(std::slice::from_mut(&mut peer), std::slice::from_ref(&m));
        errors.push(rel_err(&out[0], &want));
    }
    assert!(errors[5] < 0.05, "{errors:?}");
    assert!(errors[5] <= errors[0], "{errors:?}");
}

#[test]
fn error_feedback_sends_every_gradient_eventually() {
    let (rows, cols) = (40, 40);
    let layout = [LowRankMatrix {
        offset: 0,
        rows,
        cols,
    }];
    let mut peer = PowerSgd::new(1, rows * cols, &layout, 3).unwrap();
    let mut sent = vec![0.0f64; rows * cols];
    let mut total = vec![0.0f64; rows * cols];
    for step in 0..30 {
        let g = random(rows * cols, 1000 + step);
        for (t, v) in total.iter_mut().zip(&g) {
            *t += f64::from(*v);
        }
        let out = round(std::slice::from_mut(&mut peer), &[g]);
        for (s, v) in sent.iter_mut().zip(&out[0]) {
            *s += f64::from(*v);
        }
    }
    // What went out is what came in, less the residual still held.
    for ((s, t), r) in sent.iter().zip(&total).zip(peer.residual()) {
        assert!((s + f64::from(*r) - t).abs() < 1e-3, "{s} + {r} != {t}");
    }
}

#[test]
fn a_momentum_decays_what_was_missed() {
    // A 30 x 24 matrix and a 10-element bias; one peer, rank 2, beta 0.9: after every round
    // the residual is beta * (the last one) + the gradient - what went out (an f64 model),
    // and the bias goes out as it came in.
    let (rows, cols, bias) = (30, 24, 10);
    let len = rows * cols + bias;
    let layout = [LowRankMatrix {
        offset: 0,
        rows,
        cols,
    }];
    let beta = 0.9f32;
    let mut peer = PowerSgd::new(2, len, &layout, 5)
        .unwrap()
        .momentum(beta)
        .unwrap();
    assert_eq!(peer.beta(), beta);
    let mut model = vec![0.0f64; rows * cols];
    for step in 0..30 {
        let g = random(len, 2000 + step);
        let out = round(std::slice::from_mut(&mut peer), std::slice::from_ref(&g));
        for (i, m) in model.iter_mut().enumerate() {
            *m = f64::from(beta) * *m + f64::from(g[i]) - f64::from(out[0][i]);
            let r = f64::from(peer.residual()[i]);
            assert!((*m - r).abs() < 1e-4, "round {step} [{i}]: {m} vs {r}");
        }
        assert_eq!(out[0][rows * cols..], g[rows * cols..]);
    }
    // Bounded: without the decay the residual of rank-2 rounds on random gradients grows.
    let norm = peer
        .residual()
        .iter()
        .map(|r| f64::from(*r).powi(2))
        .sum::<f64>()
        .sqrt();
    assert!(norm < 10.0 * ((rows * cols) as f64).sqrt(), "{norm}");
    for bad in [0.0, -0.5, 1.01, f32::NAN] {
        assert!(PowerSgd::new(2, len, &layout, 5)
            .unwrap()
            .momentum(bad)
            .is_err());
    }
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let layout = [LowRankMatrix {
        offset: 0,
        rows: 20,
        cols: 20,
    }];
    assert!(PowerSgd::new(0, 400, &layout, 0).is_err());
    assert!(PowerSgd::new(MAX_RANK + 1, 400, &layout, 0).is_err());
    assert!(
        PowerSgd::new(2, 399, &layout, 0).is_err(),
        "matrix past the buffer"
    );
    let overlapping = [
        layout[0],
        LowRankMatrix {
            offset: 399,
            rows: 1,
            cols: 1,
        },
    ];
    assert!(PowerSgd::new(2, 400, &overlapping, 0).is_err());
    let huge = [LowRankMatrix {
        offset: 0,
        rows: usize::MAX,
        cols: 2,
    }];
    assert!(PowerSgd::new(2, 400, &huge, 0).is_err(), "overflowing size");
    let mut p = PowerSgd::new(2, 400, &layout, 0).unwrap();
    let mut one = vec![0.0; p.phase_one_len()];
    let mut two = vec![0.0; p.phase_two_len()];
    let mut g = random(400, 9);
    assert!(p.middle(&mut one, &mut two).is_err(), "no round begun");
    g[7] = f32::NAN;
    assert!(matches!(
        p.begin(&g, &mut one),
        Err(Error::NonFiniteInput { index: 7, .. })
    ));
    g[7] = 0.5;
    assert!(p.begin(&g[..399], &mut one).is_err());
    p.begin(&g, &mut one).unwrap();
    let mut poisoned = one.clone();
    poisoned[0] = f32::INFINITY;
    assert!(p.middle(&mut poisoned, &mut two).is_err());
    let q_before = p.q.clone();
    p.abort();
    assert_eq!(p.q, q_before);
    assert!(p.residual().iter().all(|&r| r == 0.0));
}
