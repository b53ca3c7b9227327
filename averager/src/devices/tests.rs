//! The CPU backend against plain f64 references on random inputs, for every op, odd device
//! counts and sizes around the block size; argument checks; the NCCL backend's errors.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// Random buffers, one per device.
fn random(devices: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..devices)
        .map(|_| (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect())
        .collect()
}

fn loaded(backend_inputs: &[Vec<f32>]) -> LocalGroup {
    let len = backend_inputs[0].len();
    let mut g = LocalGroup::cpu(backend_inputs.len(), len).unwrap();
    for (d, x) in backend_inputs.iter().enumerate() {
        g.load(d, x).unwrap();
    }
    g
}

/// `sum_d c_d x_d * post`, in f64.
fn reference(inputs: &[Vec<f32>], coeffs: &[f64], post: f64) -> Vec<f64> {
    let mut out = vec![0.0f64; inputs[0].len()];
    for (x, c) in inputs.iter().zip(coeffs) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o += c * f64::from(v);
        }
    }
    out.iter().map(|o| o * post).collect()
}

/// Largest `|a - b|` relative to the largest `|b|` (1 when `b` is all zeros).
fn max_err(a: &[f32], b: &[f64]) -> f64 {
    let scale = b.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(&x, y)| (f64::from(x) - y).abs() / scale)
        .fold(0.0, f64::max)
}

#[test]
fn a_group_can_move_to_another_thread() {
    fn send<T: Send>() {}
    send::<LocalGroup>();
    let mut g = LocalGroup::cpu(2, 3).unwrap();
    g.load(1, &[1.0, 2.0, 3.0]).unwrap();
    let g = std::thread::spawn(move || {
        g.broadcast(1).unwrap();
        g
    })
    .join()
    .unwrap();
    assert_eq!(g.host_buffer(0).unwrap(), &[1.0, 2.0, 3.0]);
}

#[test]
fn parts_tile_the_vector_in_order() {
    for len in [0, 1, 5, 4096, 10_001] {
        for n in 1..=7 {
            let mut at = 0;
            for d in 0..n {
                let r = part(len, n, d);
                assert_eq!(r.start, at);
                assert!(r.len() <= len / n + 1);
                at = r.end;
            }
            assert_eq!(at, len);
        }
    }
}

#[test]
fn all_reduce_matches_the_reference_for_every_op() {
    for devices in [1, 2, 3, 5] {
        for len in [0, 1, 7, 3 * 4096 + 5] {
            let inputs = random(devices, len, (devices * 1000 + len) as u64);
            let weights: Vec<f32> = (0..devices).map(|d| 0.5 + d as f32).collect();
            let wsum: f64 = weights.iter().map(|&w| f64::from(w)).sum();
            let cases: [(ReduceOp, Vec<f64>, f64); 3] = [
                (ReduceOp::Sum, vec![1.0; devices], 1.0),
                (ReduceOp::Mean, vec![1.0; devices], 1.0 / devices as f64),
                (
                    ReduceOp::WeightedMean(&weights),
                    weights.iter().map(|&w| f64::from(w)).collect(),
                    1.0 / wsum,
                ),
            ];
            for (op, coeffs, post) in cases {
                let expected = reference(&inputs, &coeffs, post);
                let mut g = loaded(&inputs);
                g.all_reduce(op).unwrap();
                let first = g.host_buffer(0).unwrap().to_vec();
                for d in 0..devices {
                    let got = g.host_buffer(d).unwrap();
                    assert!(
                        max_err(got, &expected) < 1e-6,
                        "{op:?} n={devices} len={len}"
                    );
                    assert_eq!(got, &first[..], "devices hold bit-identical results");
                }
            }
        }
    }
}

#[test]
fn reduce_writes_only_the_root() {
    let inputs = random(4, 9000, 7);
    let mut g = loaded(&inputs);
    g.reduce(2, ReduceOp::Sum).unwrap();
    let expected = reference(&inputs, &[1.0; 4], 1.0);
    assert!(max_err(g.host_buffer(2).unwrap(), &expected) < 1e-6);
    for d in [0, 1, 3] {
        assert_eq!(g.host_buffer(d).unwrap(), &inputs[d][..]);
    }
}

#[test]
fn broadcast_and_all_gather_copy_exactly() {
    for devices in [1, 3, 4] {
        for len in [1, 10, 2 * 4096 + 3] {
            let inputs = random(devices, len, 99);
            let mut g = loaded(&inputs);
            g.broadcast(devices - 1).unwrap();
            for d in 0..devices {
                assert_eq!(g.host_buffer(d).unwrap(), &inputs[devices - 1][..]);
            }
            let mut g = loaded(&inputs);
            g.all_gather().unwrap();
            let expected: Vec<f32> = (0..devices)
                .flat_map(|d| inputs[d][g.part(d)].to_vec())
                .collect();
            for d in 0..devices {
                assert_eq!(g.host_buffer(d).unwrap(), &expected[..]);
            }
        }
    }
}

#[test]
fn a_group_runs_many_collectives_in_a_row() {
    let mut g = LocalGroup::cpu(3, 5000).unwrap();
    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..200 {
        for d in 0..3 {
            let v = rng.gen_range(-4.0f32..4.0);
            g.host_buffer_mut(d).unwrap().fill(v);
        }
        let expect: f32 = (0..3).map(|d| g.host_buffer(d).unwrap()[0]).sum();
        match rng.gen_range(0..3) {
            0 => g.all_reduce(ReduceOp::Sum).unwrap(),
            1 => {
                let root = rng.gen_range(0..3);
                g.reduce(root, ReduceOp::Sum).unwrap();
                g.broadcast(root).unwrap();
            }
            _ => {
                g.all_reduce(ReduceOp::Sum).unwrap();
                g.all_gather().unwrap();
            }
        }
        for d in 0..3 {
            assert!(g
                .host_buffer(d)
                .unwrap()
                .iter()
                .all(|&x| (x - expect).abs() <= 1e-5));
        }
    }
}

#[test]
fn bad_arguments_are_errors() {
    assert!(matches!(LocalGroup::cpu(0, 1), Err(LocalError::Invalid(_))));
    assert!(matches!(
        LocalGroup::cpu(MAX_DEVICES + 1, 1),
        Err(LocalError::Invalid(_))
    ));
    let mut g = LocalGroup::cpu(2, 4).unwrap();
    assert!(matches!(g.load(2, &[0.0; 4]), Err(LocalError::Invalid(_))));
    assert!(matches!(g.load(0, &[0.0; 3]), Err(LocalError::Invalid(_))));
    assert!(matches!(
        g.store(0, &mut [0.0; 5]),
        Err(LocalError::Invalid(_))
    ));
    assert!(matches!(g.broadcast(2), Err(LocalError::Invalid(_))));
    assert!(matches!(
        g.reduce(5, ReduceOp::Sum),
        Err(LocalError::Invalid(_))
    ));
    for w in [
        &[1.0][..],
        &[1.0, -1.0],
        &[0.0, 0.0],
        &[f32::NAN, 1.0],
        &[f32::MAX, f32::MAX],
    ] {
        assert!(
            matches!(
                g.all_reduce(ReduceOp::WeightedMean(w)),
                Err(LocalError::InvalidWeights { .. })
            ),
            "{w:?}"
        );
    }
    assert!(g.host_buffer(2).is_none());
    assert_eq!(g.backend(), Backend::Cpu);
    assert_eq!(
        format!("{g:?}"),
        "LocalGroup { backend: Cpu, devices: 2, len: 4 }"
    );
}

/// Without the `cuda` feature, or on a machine without a driver or NCCL, the NCCL backend is a
/// clear error, never a panic. On a GPU machine (`STARLING_REQUIRE_GPU=1` makes a missing GPU a
/// failure) it must match the reference on every GPU.
#[test]
fn nccl_matches_the_reference_or_says_why_it_cannot_run() {
    let report = DeviceReport::probe();
    let devices = report.gpus.len().clamp(1, 8);
    let required = std::env::var("STARLING_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match LocalGroup::nccl(devices, 1000) {
        Err(e) => {
            assert!(
                !required,
                "STARLING_REQUIRE_GPU=1 but NCCL failed: {e} ({report})"
            );
            let text = e.to_string();
            #[cfg(not(feature = "cuda"))]
            assert!(matches!(e, LocalError::NoCudaSupport), "{text}");
            #[cfg(feature = "cuda")]
            assert!(
                matches!(
                    e,
                    LocalError::NoDriver
                        | LocalError::NoNccl { .. }
                        | LocalError::NotEnoughDevices { .. }
                        | LocalError::Cuda(_)
                ),
                "{text}"
            );
            eprintln!("NCCL backend not available (expected without a GPU): {text}");
        }
        Ok(g) => nccl_checks(g),
    }
}

fn nccl_checks(mut g: LocalGroup) {
    let n = g.devices();
    for len in [1usize, 1000, 1 << 20] {
        if len != g.len() {
            g = LocalGroup::nccl(n, len).unwrap();
        }
        let inputs = random(n, len, 5);
        let load = |g: &mut LocalGroup| {
            for (d, x) in inputs.iter().enumerate() {
                g.load(d, x).unwrap();
            }
        };
        let weights: Vec<f32> = (0..n).map(|d| 1.0 + d as f32).collect();
        let wsum: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        let wcoeffs: Vec<f64> = weights.iter().map(|&w| f64::from(w)).collect();
        let cases: [(ReduceOp, &[f64], f64); 3] = [
            (ReduceOp::Sum, &[1.0; 8][..n], 1.0),
            (ReduceOp::Mean, &[1.0; 8][..n], 1.0 / n as f64),
            (ReduceOp::WeightedMean(&weights), &wcoeffs, 1.0 / wsum),
        ];
        let mut out = vec![0.0f32; len];
        for (op, coeffs, post) in cases {
            load(&mut g);
            g.all_reduce(op).unwrap();
            let expected = reference(&inputs, coeffs, post);
            for d in 0..n {
                g.store(d, &mut out).unwrap();
                assert!(max_err(&out, &expected) < 1e-6, "{op:?} len={len}");
            }
            load(&mut g);
            g.reduce(n - 1, op).unwrap();
            g.store(n - 1, &mut out).unwrap();
            assert!(max_err(&out, &expected) < 1e-6, "reduce {op:?} len={len}");
        }
        load(&mut g);
        g.broadcast(0).unwrap();
        for d in 0..n {
            g.store(d, &mut out).unwrap();
            assert_eq!(out, inputs[0]);
        }
        load(&mut g);
        g.all_gather().unwrap();
        let expected: Vec<f32> = (0..n).flat_map(|d| inputs[d][g.part(d)].to_vec()).collect();
        for d in 0..n {
            g.store(d, &mut out).unwrap();
            assert_eq!(out, expected);
        }
    }
}
