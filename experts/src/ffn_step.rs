//! The feed-forward expert's training step without autograd.
//!
//! candle's general autograd recomputes the whole forward, builds a graph and keeps every
//! intermediate; its AdamW allocates a dozen tensors per parameter. For
//! `y = GELU(x W1ᵀ + b1) W2ᵀ + b2` the gradients are four matrix products and one elementwise
//! pass, derived by hand:
//!
//! ```text
//! h_pre = x W1ᵀ + b1          (recomputed: the only product of the forward needed)
//! h     = GELU(h_pre)
//! dW2   = gᵀ h,   db2 = Σ_rows g
//! dh    = g W2
//! dpre  = dh ⊙ GELU'(h_pre)
//! dW1   = dpreᵀ x, db1 = Σ_rows dpre
//! dx    = dpre W1
//! ```
//!
//! GELU is candle's (the tanh approximation), with `tanh` computed by [`fast_tanh`] so the
//! elementwise passes vectorize; [`ffn_forward`] uses the same function, so `GELU'` is the exact
//! derivative of what the forward computes.
//! The optimizer ([`FlatAdamW`]) is candle-nn's AdamW (PyTorch's definition) as one fused loop
//! per parameter over flat buffers.

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};
use rayon::prelude::*;

use crate::backend::AdamWSpec;
use crate::Result;

const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
/// Elements per parallel piece of an elementwise pass (smaller passes stay on one thread).
const PAR_MIN: usize = 1 << 14;
const GELU_A: f32 = 0.044715;

/// Where one backward call's time went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BackwardPhases {
    /// Recomputing what the gradients need of the forward.
    pub recompute: Duration,
    /// The gradients (parameters and input).
    pub gradients: Duration,
    /// The optimizer step.
    pub optimizer: Duration,
    /// Rows whose forward activations were reused instead of recomputed
    /// ([`crate::ActivationReuse`]).
    pub reused_rows: usize,
}

/// `tanh(u)` in plain f32 arithmetic, without libm: no branches and no calls, so the compiler
/// vectorizes the loops that use it (libm's `tanhf` is a call per element, about 13 ns; this
/// is below 1 ns). Absolute error below 5e-7 (tested against f64).
///
/// `tanh(|u|) = (1 − e) / (1 + e)` with `e = exp(−2|u|)`; the exponential is `2^k · p(r)` with
/// `k` the nearest integer to `−2|u| / ln 2`, `|r| ≤ ln 2 / 2`, and `p` the Taylor polynomial of
/// degree 7 (truncation below 1e-8 there). `|u|` is clamped at 9, where `tanh` is 1 in f32.
#[inline(always)]
pub(crate) fn fast_tanh(u: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that `k · LN2_HI` is exact for the small `k` used here.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5 · 2^23 rounds to the nearest integer in f32 arithmetic.
    const ROUND: f32 = 12_582_912.0;
    let x = -2.0 * u.abs().min(9.0);
    let k = (x * LOG2E + ROUND) - ROUND;
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
    // 2^k for k in [-26, 0]: the exponent field directly.
    let e = p * f32::from_bits(((k as i32 + 127) as u32) << 23);
    ((1.0 - e) / (1.0 + e)).copysign(u)
}

/// `tanh(√(2/π)·(x + a·x³))`: the GELU is `x/2·(1 + t)` (candle's tanh approximation).
#[inline(always)]
fn gelu_tanh(x: f32) -> f32 {
    fast_tanh(SQRT_TWO_OVER_PI * x * (1.0 + GELU_A * x * x))
}

/// The derivative of the tanh-approximated GELU at `x`, given `t = gelu_tanh(x)`.
#[inline(always)]
fn gelu_derivative(x: f32, t: f32) -> f32 {
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_TWO_OVER_PI * (1.0 + 3.0 * GELU_A * x * x)
}

/// The feed-forward expert's parameters: `w1 [hidden, dim]`, `b1 [hidden]`, `w2 [dim, hidden]`,
/// `b2 [dim]` (candle's `Linear` layout).
pub(crate) struct FfnVars {
    pub w1: Var,
    pub b1: Var,
    pub w2: Var,
    pub b2: Var,
}

/// Rows of a `[rows, width]` buffer per parallel piece: pieces of at least [`PAR_MIN`] elements.
fn rows_per_piece(width: usize) -> usize {
    PAR_MIN.div_ceil(width.max(1)).max(1)
}

/// Runs `f` on every row of the `[rows, width]` buffer `values`, rows spread over the cores.
fn par_rows(values: &mut [f32], width: usize, f: impl Fn(&mut [f32]) + Sync) {
    values
        .par_chunks_mut(width * rows_per_piece(width))
        .for_each(|piece| piece.chunks_mut(width).for_each(&f));
}

/// Runs `f` on every pair of rows of two `[rows, width]` buffers, rows spread over the cores.
fn par_row_pairs(
    a: &mut [f32],
    b: &mut [f32],
    width: usize,
    f: impl Fn(&mut [f32], &mut [f32]) + Sync,
) {
    let piece = width * rows_per_piece(width);
    a.par_chunks_mut(piece)
        .zip(b.par_chunks_mut(piece))
        .for_each(|(pa, pb)| {
            for (ra, rb) in pa.chunks_mut(width).zip(pb.chunks_mut(width)) {
                f(ra, rb)
            }
        });
}

/// The GELU of `s`, given `t = gelu_tanh(s)`.
#[inline(always)]
fn gelu(s: f32, t: f32) -> f32 {
    0.5 * s * (1.0 + t)
}

/// `x W1ᵀ + b1` as a flat `[rows, hidden]` buffer.
fn first_layer(p: &FfnVars, x: &Tensor) -> Result<(Vec<f32>, Vec<f32>, usize)> {
    let pre = x.matmul(&p.w1.as_tensor().t()?)?;
    let (_, hidden) = pre.dims2()?;
    let bias = p.b1.as_tensor().to_vec1::<f32>()?;
    Ok((pre.flatten_all()?.to_vec1::<f32>()?, bias, hidden))
}

/// The feed-forward expert's forward, `GELU(x W1ᵀ + b1) W2ᵀ + b2`, with the bias and the GELU
/// in one pass over the hidden layer on every core (candle's GELU is one thread and libm's
/// tanh); the same function [`ffn_gradients`] differentiates. With `keep`, also returns the
/// pre-activation `x W1ᵀ + b1` (`[rows, hidden]`, flat) for a later backward.
pub(crate) fn ffn_forward(
    p: &FfnVars,
    x: &Tensor,
    keep: bool,
) -> Result<(Tensor, Option<Vec<f32>>)> {
    let (mut h, bias, hidden) = first_layer(p, x)?;
    let rows = h.len() / hidden.max(1);
    let kept = if keep {
        let mut pre = vec![0f32; h.len()];
        par_row_pairs(&mut h, &mut pre, hidden, |hr, pr| {
            for ((v, keep), b) in hr.iter_mut().zip(pr.iter_mut()).zip(&bias) {
                let s = *v + b;
                *keep = s;
                *v = gelu(s, gelu_tanh(s));
            }
        });
        Some(pre)
    } else {
        par_rows(&mut h, hidden, |row| {
            for (v, b) in row.iter_mut().zip(&bias) {
                let s = *v + b;
                *v = gelu(s, gelu_tanh(s));
            }
        });
        None
    };
    let h = Tensor::from_vec(h, (rows, hidden), &Device::Cpu)?;
    let y = h
        .matmul(&p.w2.as_tensor().t()?)?
        .broadcast_add(p.b2.as_tensor())?;
    Ok((y, kept))
}

/// Gradients of `sum(y ⊙ g)` for `y = ffn(x)`: `(dx, [dw1, db1, dw2, db2])`, and the time of
/// the recomputation and of the gradients. `pre` is the forward's `x W1ᵀ + b1` when it was
/// kept ([`crate::activations`]); otherwise it is recomputed with the current weights.
pub(crate) fn ffn_gradients(
    p: &FfnVars,
    x: &Tensor,
    g: &Tensor,
    pre: Option<Vec<f32>>,
) -> Result<(Tensor, [Tensor; 4], Duration, Duration)> {
    let started = Instant::now();
    let w1 = p.w1.as_tensor();
    let w2 = p.w2.as_tensor();
    let hidden = w1.dims2()?.0;
    // One pass: the hidden activations, and the GELU's derivative kept for the backward.
    let (mut h, bias) = match pre {
        Some(pre) => (pre, None),
        None => {
            let (values, bias, _) = first_layer(p, x)?;
            (values, Some(bias))
        }
    };
    let rows = h.len() / hidden.max(1);
    let mut slope = vec![0f32; h.len()];
    let pass = |v: &mut f32, d: &mut f32, s: f32| {
        let t = gelu_tanh(s);
        *v = gelu(s, t);
        *d = gelu_derivative(s, t);
    };
    par_row_pairs(&mut h, &mut slope, hidden, |hr, dr| match &bias {
        Some(bias) => {
            for ((v, d), b) in hr.iter_mut().zip(dr.iter_mut()).zip(bias) {
                pass(v, d, *v + b)
            }
        }
        None => {
            for (v, d) in hr.iter_mut().zip(dr.iter_mut()) {
                pass(v, d, *v)
            }
        }
    });
    let h = Tensor::from_vec(h, (rows, hidden), &Device::Cpu)?;
    let recomputed = Instant::now();
    let dw2 = g.t()?.matmul(&h)?;
    let db2 = g.sum(0)?;
    let mut dpre = g.matmul(w2)?.flatten_all()?.to_vec1::<f32>()?;
    dpre.par_chunks_mut(PAR_MIN)
        .zip(slope.par_chunks(PAR_MIN))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d *= s));
    let dpre = Tensor::from_vec(dpre, (rows, hidden), &Device::Cpu)?;
    let dw1 = dpre.t()?.matmul(x)?;
    let db1 = dpre.sum(0)?;
    let dx = dpre.matmul(w1)?;
    let done = Instant::now();
    Ok((
        dx,
        [dw1, db1, dw2, db2],
        recomputed - started,
        done - recomputed,
    ))
}

/// AdamW over an expert's candle `Var`s: the same arithmetic as candle-nn's `AdamW` and as
/// `starling_training::AdamW` (both PyTorch's; the test below checks it against candle-nn's), in
/// one pass per parameter.
///
/// Why a third AdamW: training's works on one flat `ParamSet` buffer whose steps must be
/// bit-identical across peers, and experts/ does not depend on training/ (they are siblings);
/// candle-nn's builds new tensors for every operation of the update, while an expert steps on
/// every backward it serves: this one keeps per-tensor moments in plain vectors and writes each
/// `Var` once.
pub(crate) struct FlatAdamW {
    spec: AdamWSpec,
    moments: Vec<(Vec<f32>, Vec<f32>)>,
    step: u64,
}

impl FlatAdamW {
    /// State for `vars` (zero moments).
    pub fn new(spec: AdamWSpec, vars: &[&Var]) -> Self {
        FlatAdamW {
            spec,
            moments: vars
                .iter()
                .map(|v| (vec![0.0; v.elem_count()], vec![0.0; v.elem_count()]))
                .collect(),
            step: 0,
        }
    }

    /// One step: `vars[i] -= update(grads[i])`.
    pub fn step(&mut self, vars: &[&Var], grads: &[Tensor]) -> Result<()> {
        self.step += 1;
        let s = self.spec;
        let (b1, b2) = (s.beta1, s.beta2);
        let scale_m = (1.0 / (1.0 - b1.powi(self.step as i32))) as f32;
        let scale_v = (1.0 / (1.0 - b2.powi(self.step as i32))) as f32;
        let decay = (1.0 - s.lr * s.weight_decay) as f32;
        let (lr, eps) = (s.lr as f32, s.eps as f32);
        let (b1, b2) = (b1 as f32, b2 as f32);
        for ((var, grad), (m, v)) in vars.iter().zip(grads).zip(&mut self.moments) {
            let mut theta = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            let g = grad.flatten_all()?.to_vec1::<f32>()?;
            // One thread: on every core (rayon) this step took 60-70 us per sample instead of
            // 36 under a loaded server (bench experts, H=1024), the other core being busy
            // with the network.
            for (((t, g), m), v) in theta.iter_mut().zip(&g).zip(m.iter_mut()).zip(v.iter_mut()) {
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                let m_hat = *m * scale_m;
                let v_hat = *v * scale_v;
                *t = *t * decay - lr * (m_hat / (v_hat.sqrt() + eps));
            }
            var.set(&Tensor::from_vec(theta, var.shape(), &Device::Cpu)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_nn::{AdamW, Optimizer, ParamsAdamW};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn randn(shape: &[usize], rng: &mut StdRng) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let num: f32 = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum();
        let den: f32 = b.iter().map(|y| y * y).sum();
        (num / den.max(1e-30)).sqrt()
    }

    fn vars(rng: &mut StdRng, dim: usize, hidden: usize) -> FfnVars {
        let var = |shape: &[usize], rng: &mut StdRng| Var::from_tensor(&randn(shape, rng)).unwrap();
        FfnVars {
            w1: var(&[hidden, dim], rng),
            b1: var(&[hidden], rng),
            w2: var(&[dim, hidden], rng),
            b2: var(&[dim], rng),
        }
    }

    /// candle's `Linear - GELU - Linear` (libm tanh), differentiable: the reference.
    fn candle_ffn(p: &FfnVars, x: &Tensor) -> Tensor {
        x.matmul(&p.w1.as_tensor().t().unwrap())
            .unwrap()
            .broadcast_add(p.b1.as_tensor())
            .unwrap()
            .gelu()
            .unwrap()
            .matmul(&p.w2.as_tensor().t().unwrap())
            .unwrap()
            .broadcast_add(p.b2.as_tensor())
            .unwrap()
    }

    /// The hand-derived gradients equal candle's autograd on random data (rel. error < 1e-5).
    #[test]
    fn hand_derived_gradients_equal_autograd() {
        let mut rng = StdRng::seed_from_u64(1);
        let (dim, hidden, rows) = (24, 96, 37);
        let p = vars(&mut rng, dim, hidden);
        let x = Var::from_tensor(&randn(&[rows, dim], &mut rng)).unwrap();
        let g = randn(&[rows, dim], &mut rng);
        let y = candle_ffn(&p, x.as_tensor());
        let auto = (y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let (dx, [dw1, db1, dw2, db2], _, _) = ffn_gradients(&p, x.as_tensor(), &g, None).unwrap();
        // The same from the forward's kept pre-activation.
        let (_, kept) = ffn_forward(&p, x.as_tensor(), true).unwrap();
        let (dx_kept, grads_kept, _, _) = ffn_gradients(&p, x.as_tensor(), &g, kept).unwrap();
        assert!(rel(&dx_kept, &dx) < 1e-6);
        for (a, b) in grads_kept.iter().zip([&dw1, &db1, &dw2, &db2]) {
            assert!(rel(a, b) < 1e-6);
        }
        for (name, mine, var) in [
            ("dx", &dx, &x),
            ("dw1", &dw1, &p.w1),
            ("db1", &db1, &p.b1),
            ("dw2", &dw2, &p.w2),
            ("db2", &db2, &p.b2),
        ] {
            let reference = auto.get(var.as_tensor()).unwrap();
            assert_eq!(mine.dims(), reference.dims(), "{name}");
            let e = rel(mine, reference);
            assert!(e < 1e-5, "{name}: relative error {e}");
        }
    }

    /// Three steps of the flat AdamW equal candle-nn's AdamW (rel. error < 1e-6), weight decay
    /// included.
    #[test]
    fn flat_adamw_equals_candles() {
        let mut rng = StdRng::seed_from_u64(2);
        let spec = AdamWSpec {
            lr: 1e-2,
            weight_decay: 0.1,
            ..AdamWSpec::default()
        };
        let a = Var::from_tensor(&randn(&[5, 7], &mut rng)).unwrap();
        let b = Var::from_tensor(a.as_tensor()).unwrap();
        let mut theirs = AdamW::new(
            vec![a.clone()],
            ParamsAdamW {
                lr: spec.lr,
                beta1: spec.beta1,
                beta2: spec.beta2,
                eps: spec.eps,
                weight_decay: spec.weight_decay,
            },
        )
        .unwrap();
        let mut mine = FlatAdamW::new(spec, &[&b]);
        for _ in 0..3 {
            let g = randn(&[5, 7], &mut rng);
            let grads = (a.as_tensor() * &g)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            theirs.step(&grads).unwrap();
            mine.step(&[&b], &[g]).unwrap();
        }
        let e = rel(b.as_tensor(), a.as_tensor());
        assert!(e < 1e-6, "relative error {e}");
    }

    /// `fast_tanh` against f64's `tanh` over a dense sweep, tails and signed zero included.
    #[test]
    fn fast_tanh_is_accurate() {
        let mut worst = 0f64;
        for i in -200_000..=200_000 {
            let u = i as f32 * 1e-4; // [-20, 20]
            let e = (fast_tanh(u) as f64 - (u as f64).tanh()).abs();
            worst = worst.max(e);
        }
        assert!(worst < 5e-7, "max abs error {worst}");
        assert_eq!(fast_tanh(0.0), 0.0);
        assert_eq!(fast_tanh(f32::INFINITY), 1.0);
        assert_eq!(fast_tanh(f32::NEG_INFINITY), -1.0);
        assert!(fast_tanh(1e-30).abs() < 1e-6);
    }

    /// The fused forward equals candle's `Linear - GELU - Linear` (rel. error < 1e-5), on
    /// batch sizes that split and do not split into parallel pieces.
    #[test]
    fn fused_forward_equals_candles() {
        let mut rng = StdRng::seed_from_u64(3);
        for (dim, hidden, rows) in [(24, 96, 1), (24, 96, 37), (64, 256, 300)] {
            let p = vars(&mut rng, dim, hidden);
            let x = randn(&[rows, dim], &mut rng);
            let reference = candle_ffn(&p, &x);
            let (mine, kept) = ffn_forward(&p, &x, true).unwrap();
            let (plain, none) = ffn_forward(&p, &x, false).unwrap();
            assert!(none.is_none() && kept.is_some_and(|k| k.len() == rows * hidden));
            assert_eq!(rel(&plain, &mine), 0.0);
            assert_eq!(mine.dims(), reference.dims());
            let e = rel(&mine, &reference);
            assert!(e < 1e-5, "{dim}x{hidden}, {rows} rows: relative error {e}");
        }
    }

    #[test]
    fn gelu_derivative_matches_finite_differences() {
        let gelu = |x: f64| {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
        };
        for x in [-3.0f32, -1.0, -0.1, 0.0, 0.3, 1.7, 4.0] {
            let h = 1e-4;
            let fd = (gelu(x as f64 + h) - gelu(x as f64 - h)) / (2.0 * h);
            let mine = gelu_derivative(x, gelu_tanh(x)) as f64;
            assert!((fd - mine).abs() < 1e-4, "at {x}: {fd} vs {mine}");
        }
    }
}
