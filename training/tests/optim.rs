//! Optimizers against plain f64 references written from PyTorch's documented algorithms, against
//! hand-computed values, and for bit-identity across peers, state round-trips and buffer splits.

use proptest::prelude::*;
use rand::{rngs::StdRng, Rng, SeedableRng};
use starling_training::{
    AdamW, AdamWConfig, LrSchedule, OptimError, Optimizer, OptimizerConfig, Sgd, SgdConfig,
};

/// `torch.optim.SGD`'s documented algorithm in f64.
struct RefSgd {
    c: SgdConfig,
    buf: Vec<f64>,
    t: u64,
}

impl RefSgd {
    fn step(&mut self, p: &mut [f64], g: &[f32]) {
        self.t += 1;
        for i in 0..p.len() {
            let mut d = f64::from(g[i]) + self.c.weight_decay * p[i];
            if self.c.momentum != 0.0 {
                self.buf[i] = if self.t > 1 {
                    self.c.momentum * self.buf[i] + (1.0 - self.c.dampening) * d
                } else {
                    d
                };
                d = if self.c.nesterov {
                    d + self.c.momentum * self.buf[i]
                } else {
                    self.buf[i]
                };
            }
            p[i] -= self.c.lr * d;
        }
    }
}

/// `torch.optim.AdamW`'s documented algorithm in f64 (bias-corrected m̂ and v̂, eps outside the root).
struct RefAdamW {
    c: AdamWConfig,
    m: Vec<f64>,
    v: Vec<f64>,
    t: i32,
}

impl RefAdamW {
    fn step(&mut self, p: &mut [f64], g: &[f32]) {
        self.t += 1;
        let c = self.c;
        for i in 0..p.len() {
            let g = f64::from(g[i]);
            p[i] -= c.lr * c.weight_decay * p[i];
            self.m[i] = c.beta1 * self.m[i] + (1.0 - c.beta1) * g;
            self.v[i] = c.beta2 * self.v[i] + (1.0 - c.beta2) * g * g;
            let m_hat = self.m[i] / (1.0 - c.beta1.powi(self.t));
            let v_hat = self.v[i] / (1.0 - c.beta2.powi(self.t));
            p[i] -= c.lr * m_hat / (v_hat.sqrt() + c.eps);
        }
    }
}

fn random_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f64], abs: f64, rel: f64) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(
            err <= abs + rel * w.abs(),
            "{what}[{i}]: {g} vs reference {w} (error {err:e})"
        );
    }
}

/// Tolerances: f32 rounding of each operation is ~6e-8 relative; over 30 steps the parameters drift
/// from the f64 reference by far less than 1e-5 absolute (values are O(1)).
#[test]
fn sgd_matches_the_f64_reference() {
    let configs = [
        SgdConfig::new(0.05),
        SgdConfig::new(0.05).weight_decay(0.01),
        SgdConfig::new(0.02).momentum(0.9),
        SgdConfig::new(0.02)
            .momentum(0.9)
            .dampening(0.3)
            .weight_decay(1e-3),
        SgdConfig::new(0.01)
            .momentum(0.95)
            .nesterov(true)
            .weight_decay(1e-2),
    ];
    let mut rng = StdRng::seed_from_u64(11);
    for c in configs {
        let n = 257;
        let p0 = random_vec(&mut rng, n, 1.0);
        let mut ours = p0.clone();
        let mut reference: Vec<f64> = p0.iter().map(|&v| f64::from(v)).collect();
        let mut opt = Sgd::new(c, n).unwrap();
        let mut r = RefSgd {
            c,
            buf: vec![0.0; n],
            t: 0,
        };
        for _ in 0..30 {
            let g = random_vec(&mut rng, n, 2.0);
            opt.step(&mut ours, &g).unwrap();
            r.step(&mut reference, &g);
        }
        assert_close(&format!("{c:?} params"), &ours, &reference, 1e-5, 1e-5);
        if let Some((_, buf)) = opt.state().first() {
            assert_close("momentum_buffer", buf, &r.buf, 1e-5, 1e-5);
        }
    }
}

#[test]
fn adamw_matches_the_f64_reference() {
    let configs = [
        AdamWConfig::default(),
        AdamWConfig::new(1e-2).weight_decay(0.1),
        AdamWConfig::new(3e-3)
            .betas(0.8, 0.95)
            .eps(1e-6)
            .weight_decay(0.0),
    ];
    let mut rng = StdRng::seed_from_u64(12);
    for c in configs {
        let n = 301;
        let p0 = random_vec(&mut rng, n, 1.0);
        let mut ours = p0.clone();
        let mut reference: Vec<f64> = p0.iter().map(|&v| f64::from(v)).collect();
        let mut opt = AdamW::new(c, n).unwrap();
        let mut r = RefAdamW {
            c,
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
        };
        for step in 0..30 {
            // Gradients of mixed magnitudes, some far below eps's scale.
            let scale = if step % 3 == 0 { 1e-3 } else { 1.0 };
            let g = random_vec(&mut rng, n, scale);
            opt.step(&mut ours, &g).unwrap();
            r.step(&mut reference, &g);
        }
        assert_close(&format!("{c:?} params"), &ours, &reference, 1e-5, 1e-5);
        let state = opt.state();
        // Moments are sums of O(0.1) terms that can cancel to near zero: bound their absolute error.
        assert_close("exp_avg", state[0].1, &r.m, 1e-6, 1e-5);
        assert_close("exp_avg_sq", state[1].1, &r.v, 1e-7, 1e-5);
    }
}

/// Values worked out by hand (see the comments); tolerance 1e-6.
#[test]
fn hand_computed_steps() {
    // SGD, momentum 0.9, Nesterov: step 1 d = 0.5 + 0.9 * 0.5 = 0.95, p = 1 - 0.095 = 0.905;
    // step 2 buf = 0.9 * 0.5 + 0.5 = 0.95, d = 0.5 + 0.9 * 0.95 = 1.355, p = 0.905 - 0.1355 = 0.7695.
    let mut sgd = Sgd::new(SgdConfig::new(0.1).momentum(0.9).nesterov(true), 1).unwrap();
    let mut p = [1.0f32];
    sgd.step(&mut p, &[0.5]).unwrap();
    assert!((p[0] - 0.905).abs() < 1e-6, "{}", p[0]);
    sgd.step(&mut p, &[0.5]).unwrap();
    assert!((p[0] - 0.7695).abs() < 1e-6, "{}", p[0]);

    // SGD with weight decay 0.1: d = 0.5 + 0.1 * 2 = 0.7, p = 2 - 0.1 * 0.7 = 1.93.
    let mut sgd = Sgd::new(SgdConfig::new(0.1).weight_decay(0.1), 1).unwrap();
    let mut p = [2.0f32];
    sgd.step(&mut p, &[0.5]).unwrap();
    assert!((p[0] - 1.93).abs() < 1e-6, "{}", p[0]);

    // AdamW lr 0.1, wd 0.1, default betas, from p = 1 with g = 0.5 then g = -1:
    // t=1: p = 0.99; m = 0.05, v = 0.00025, m̂ = 0.5, v̂ = 0.25; p = 0.99 - 0.1 * 0.5 / 0.5 = 0.89.
    // t=2: p = 0.89 * 0.99 = 0.8811; m = 0.045 - 0.1 = -0.055, m̂ = -0.055 / 0.19 = -0.289474;
    //      v = 0.00024975 + 0.001 = 0.00124975, v̂ = 0.00124975 / 0.001999 = 0.625188, √ = 0.790688;
    //      p = 0.8811 + 0.1 * 0.289474 / 0.790688 = 0.8811 + 0.0366104 = 0.9177104.
    let mut adam = AdamW::new(AdamWConfig::new(0.1).weight_decay(0.1), 1).unwrap();
    let mut p = [1.0f32];
    adam.step(&mut p, &[0.5]).unwrap();
    assert!((p[0] - 0.89).abs() < 1e-6, "{}", p[0]);
    adam.step(&mut p, &[-1.0]).unwrap();
    assert!((p[0] - 0.917_710_4).abs() < 1e-6, "{}", p[0]);
    assert!((adam.state()[0].1[0] + 0.055).abs() < 1e-7);
    assert!((adam.state()[1].1[0] - 0.001_249_75).abs() < 1e-9);
}

#[test]
fn lr_changes_between_steps_take_effect() {
    let mut sgd = Sgd::new(SgdConfig::new(0.1), 1).unwrap();
    let mut p = [0.0f32];
    let schedule = LrSchedule::WarmupCosine {
        peak_lr: 1.0,
        min_lr: 0.0,
        warmup_steps: 2,
        total_steps: 4,
    };
    let mut lrs = Vec::new();
    for _ in 0..5 {
        lrs.push(schedule.apply(&mut sgd));
        sgd.step(&mut p, &[-1.0]).unwrap();
    }
    // Warmup 0.5, 1.0; cosine 1.0, 0.5; after the end 0.
    assert_eq!(lrs[..2], [0.5, 1.0]);
    assert!((lrs[2] - 1.0).abs() < 1e-15 && (lrs[3] - 0.5).abs() < 1e-15 && lrs[4] == 0.0);
    let sum: f64 = lrs.iter().sum();
    assert!((f64::from(p[0]) - sum).abs() < 1e-6);
}

#[test]
fn wrong_lengths_are_errors_not_panics() {
    let mut adam = AdamW::new(AdamWConfig::default(), 4).unwrap();
    let mut p = [0.0f32; 3];
    let err = adam.step(&mut p, &[0.0; 3]).unwrap_err();
    assert_eq!(
        err,
        OptimError::Length {
            expected: 4,
            params: 3,
            grads: 3
        }
    );
    assert_eq!(adam.steps(), 0);
    let mut sgd = Sgd::new(SgdConfig::default(), 2).unwrap();
    assert!(sgd.step(&mut [0.0; 2], &[0.0; 1]).is_err());
}

#[test]
fn invalid_hyper_parameters_are_refused() {
    assert!(Sgd::new(SgdConfig::new(f64::NAN), 1).is_err());
    assert!(Sgd::new(
        SgdConfig::new(0.1)
            .momentum(0.9)
            .dampening(0.1)
            .nesterov(true),
        1
    )
    .is_err());
    assert!(AdamW::new(AdamWConfig::new(0.1).betas(0.9, 1.0), 1).is_err());
    assert!(AdamW::new(AdamWConfig::new(0.1).weight_decay(-1.0), 1).is_err());
}

fn any_config() -> impl Strategy<Value = OptimizerConfig> {
    let sgd = (
        1e-4f64..0.5,
        0.0f64..0.99,
        any::<bool>(),
        0.0f64..0.1,
        0.0f64..0.5,
    )
        .prop_map(|(lr, momentum, nesterov, wd, damp)| {
            let c = SgdConfig::new(lr).momentum(momentum).weight_decay(wd);
            OptimizerConfig::Sgd(if nesterov && momentum > 0.0 {
                c.nesterov(true)
            } else {
                c.dampening(damp)
            })
        });
    let adamw = (
        1e-5f64..0.1,
        0.5f64..0.99,
        0.9f64..0.9999,
        1e-10f64..1e-4,
        0.0f64..0.2,
    )
        .prop_map(|(lr, b1, b2, eps, wd)| {
            OptimizerConfig::AdamW(AdamWConfig::new(lr).betas(b1, b2).eps(eps).weight_decay(wd))
        });
    prop_oneof![sgd, adamw]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn state_bits(opt: &dyn Optimizer) -> Vec<(&'static str, Vec<u32>)> {
    opt.state().into_iter().map(|(n, s)| (n, bits(s))).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Two peers with the same inputs end bit-identical, also when one of them rebuilt its optimizer
    /// half-way from the other's `config()`, `steps()` and `state()` (what a checkpoint or state
    /// sync transfers), and when the learning rate changes every step.
    #[test]
    fn peers_stay_bit_identical(config in any_config(), seed in any::<u64>(), n in 1usize..300, steps in 2usize..12) {
        let mut rng = StdRng::seed_from_u64(seed);
        let p0 = random_vec(&mut rng, n, 3.0);
        let grads: Vec<Vec<f32>> = (0..steps).map(|_| random_vec(&mut rng, n, 5.0)).collect();
        let lr_scale: Vec<f64> = (0..steps).map(|_| rng.gen_range(0.5..1.5)).collect();
        let (mut pa, mut pb) = (p0.clone(), p0);
        let mut a = config.build(n).unwrap();
        let mut b = config.build(n).unwrap();
        for (t, g) in grads.iter().enumerate() {
            if t == steps / 2 {
                // Peer b restarts from a's state.
                let mut fresh = a.config().build(n).unwrap();
                fresh.set_steps(a.steps());
                for ((name, dst), (src_name, src)) in fresh.state_mut().into_iter().zip(a.state()) {
                    prop_assert_eq!(name, src_name);
                    dst.copy_from_slice(src);
                }
                prop_assert_eq!(state_bits(&*fresh), state_bits(&*a));
                b = fresh;
            }
            let lr = config.lr() * lr_scale[t];
            a.set_lr(lr);
            b.set_lr(lr);
            a.step(&mut pa, g).unwrap();
            b.step(&mut pb, g).unwrap();
            prop_assert_eq!(bits(&pa), bits(&pb));
            prop_assert_eq!(state_bits(&*a), state_bits(&*b));
        }
        prop_assert_eq!(a.steps(), steps as u64);
        prop_assert_eq!(b.config(), a.config());
    }

    /// The update of an element depends on that element alone: stepping the whole buffer gives
    /// the same bits as stepping each piece with its own optimizer (vectorised loop bodies and
    /// loop tails round identically; no fused multiply-add on one path only).
    #[test]
    fn splitting_the_buffer_changes_no_bit(config in any_config(), seed in any::<u64>(), n in 1usize..200, cut in 0usize..200) {
        let cut = cut.min(n);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut whole = random_vec(&mut rng, n, 3.0);
        let mut parts = whole.clone();
        let mut opt = config.build(n).unwrap();
        let mut left = config.build(cut).unwrap();
        let mut right = config.build(n - cut).unwrap();
        for _ in 0..4 {
            let g = random_vec(&mut rng, n, 5.0);
            opt.step(&mut whole, &g).unwrap();
            let (pl, pr) = parts.split_at_mut(cut);
            left.step(pl, &g[..cut]).unwrap();
            right.step(pr, &g[cut..]).unwrap();
        }
        prop_assert_eq!(bits(&whole), bits(&parts));
    }
}

/// A second moment below zero (what averaging the optimizer state with a lossy codec can leave:
/// u4 decodes values near zero to a bin mean of either sign) must not make a parameter NaN.
/// Found by a 4-peer `starling train --codec u4` run, whose every state round after epoch 50
/// failed on NaN parameters.
#[test]
fn adamw_survives_a_negative_second_moment() {
    let mut opt = AdamW::new(AdamWConfig::new(1e-3), 4).unwrap();
    let mut p = [0.5f32, -0.5, 0.25, 1.0];
    opt.step(&mut p, &[0.1, 0.2, -0.3, 0.0]).unwrap();
    for (name, state) in opt.state_mut() {
        if name == "exp_avg_sq" {
            state.copy_from_slice(&[-1e-6, -1e-12, 1e-8, -3e-9]);
        }
    }
    opt.step(&mut p, &[0.0, 1e-7, 0.0, 0.0]).unwrap();
    assert!(p.iter().all(|v| v.is_finite()), "{p:?}");
}
