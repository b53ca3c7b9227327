//! Expert backends against references: input gradients by finite differences, seeds, kept activations, checkpoints, shapes.

use super::*;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let num: f32 = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Finite differences on the input gradient, for both architectures.
#[test]
fn input_gradients_match_finite_differences() {
    for spec in [ExpertSpec::ffn(6, 12), ExpertSpec::transformer(8, 16, 3, 2)] {
        let spec = spec.with_lr(0.0);
        let mut e = Expert::new(&spec, 1).unwrap();
        let mut shape = vec![2];
        shape.extend(spec.schema().input.shape);
        let x = randn(&shape, 2);
        let g = randn(&shape, 3);
        let grad = e.backward(&x, &g).unwrap();
        let loss = |x: &Tensor| -> f64 {
            (e.forward(x).unwrap() * &g)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64
        };
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let grads = grad.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for i in [0, xs.len() / 2, xs.len() - 1] {
            let h = 1e-2f32;
            let mut p = xs.clone();
            p[i] += h;
            let mut m = xs.clone();
            m[i] -= h;
            let lp = loss(&Tensor::from_vec(p, shape.as_slice(), &Device::Cpu).unwrap());
            let lm = loss(&Tensor::from_vec(m, shape.as_slice(), &Device::Cpu).unwrap());
            let fd = (lp - lm) / (2.0 * h as f64);
            assert!(
                (fd - grads[i] as f64).abs() < 2e-2 * (1.0 + fd.abs()),
                "{:?}: element {i}: finite difference {fd}, backward {}",
                spec.kind,
                grads[i]
            );
        }
    }
}

#[test]
fn same_seed_same_expert_and_training_changes_it() {
    let spec = ExpertSpec::ffn(8, 16);
    let mut a = Expert::new(&spec, 5).unwrap();
    let b = Expert::new(&spec, 5).unwrap();
    let c = Expert::new(&spec, 6).unwrap();
    let x = randn(&[3, 8], 9);
    let ya = a.forward(&x).unwrap();
    assert_eq!(max_rel(&ya, &b.forward(&x).unwrap()), 0.0);
    assert!(max_rel(&ya, &c.forward(&x).unwrap()) > 0.1);
    a.backward(&x, &ya.ones_like().unwrap()).unwrap();
    assert!(max_rel(&a.forward(&x).unwrap(), &ya) > 1e-4);
    assert_eq!(a.steps(), 1);
}

/// A backward that reuses its forward's activations is the backward that recomputes them
/// while the expert has not stepped; after a step it is reused only within
/// `max_stale_steps`; bad part lists and a checkpoint restore are handled.
#[test]
fn kept_activations_are_exact_until_a_step_and_bounded_after() {
    let spec = ExpertSpec::ffn(16, 64);
    let x = randn(&[10, 16], 1);
    let g = randn(&[10, 16], 2);
    // Batched as two requests, backward as one batch of both: reused and exact.
    let mut kept = Expert::new(&spec, 3).unwrap();
    let mut plain = Expert::new(&spec, 3).unwrap();
    plain.set_activation_reuse(ActivationReuse::off());
    let y = kept.forward_parts(&x, &[4, 6]).unwrap();
    assert_eq!(max_rel(&y, &plain.forward(&x).unwrap()), 0.0);
    let dx = kept.backward_parts(&x, &g, &[4, 6]).unwrap();
    assert_eq!(kept.last_backward_phases().reused_rows, 10);
    let reference = plain.backward(&x, &g).unwrap();
    assert_eq!(plain.last_backward_phases().reused_rows, 0);
    let e = max_rel(&dx, &reference);
    assert!(e < 1e-6, "dx differs: {e}");
    let (yk, yp) = (kept.forward(&x).unwrap(), plain.forward(&x).unwrap());
    assert!(max_rel(&yk, &yp) < 1e-6, "weights after the step differ");
    // A forward, another request's backward (one step), then its own backward.
    let (x1, x2) = (randn(&[5, 16], 4), randn(&[5, 16], 5));
    let late = |max_stale_steps| {
        let mut e = Expert::new(&spec, 3).unwrap();
        e.set_activation_reuse(ActivationReuse {
            max_stale_steps,
            ..ActivationReuse::default()
        });
        e.forward_parts(&x1, &[5]).unwrap();
        e.forward_parts(&x2, &[5]).unwrap();
        e.backward_parts(&x2, &g.narrow(0, 0, 5).unwrap(), &[5])
            .unwrap();
        let dx = e
            .backward_parts(&x1, &g.narrow(0, 5, 5).unwrap(), &[5])
            .unwrap();
        (dx, e.last_backward_phases().reused_rows)
    };
    let (exact, reused_exact) = late(0);
    let (delayed, reused_delayed) = late(1);
    assert_eq!((reused_exact, reused_delayed), (0, 5));
    // One AdamW step of lr 1e-3 apart: close, not equal.
    let e = max_rel(&delayed, &exact);
    assert!(e > 0.0 && e < 0.05, "delayed vs recomputed: {e}");
    // Part lists must cover the batch.
    for parts in [&[4usize, 5][..], &[10, 0], &[]] {
        assert!(kept.forward_parts(&x, parts).is_err(), "{parts:?}");
        assert!(kept.backward_parts(&x, &g, parts).is_err(), "{parts:?}");
    }
    // Restoring a checkpoint forgets what the old weights computed.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.safetensors");
    plain.save(&path).unwrap();
    kept.forward_parts(&x, &[10]).unwrap();
    kept.load(&path).unwrap();
    kept.backward_parts(&x, &g, &[10]).unwrap();
    assert_eq!(kept.last_backward_phases().reused_rows, 0);
}

#[test]
fn checkpoints_round_trip_and_refuse_other_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.safetensors");
    let spec = ExpertSpec::transformer(8, 16, 4, 2);
    let mut a = Expert::new(&spec, 1).unwrap();
    let x = randn(&[2, 4, 8], 2);
    a.backward(&x, &randn(&[2, 4, 8], 3)).unwrap();
    a.save(&path).unwrap();
    let mut b = Expert::new(&spec, 99).unwrap();
    b.load(&path).unwrap();
    assert_eq!(
        max_rel(&a.forward(&x).unwrap(), &b.forward(&x).unwrap()),
        0.0
    );
    let mut other = Expert::new(&ExpertSpec::transformer(16, 16, 4, 2), 1).unwrap();
    let before = other.forward(&randn(&[1, 4, 16], 4)).unwrap();
    assert!(other.load(&path).is_err());
    assert_eq!(
        max_rel(&other.forward(&randn(&[1, 4, 16], 4)).unwrap(), &before),
        0.0
    );
}

#[test]
fn wrong_shapes_are_refused() {
    let mut e = Expert::new(&ExpertSpec::ffn(4, 8), 1).unwrap();
    assert!(e.forward(&randn(&[2, 5], 1)).is_err());
    assert!(e.forward(&randn(&[4], 1)).is_err());
    assert!(e.backward(&randn(&[2, 4], 1), &randn(&[3, 4], 1)).is_err());
}
