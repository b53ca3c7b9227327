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
//! GELU is candle's (the tanh approximation), so `GELU'` is that function's exact derivative.
//! The optimizer ([`FlatAdamW`]) is candle-nn's AdamW (PyTorch's definition) as one fused loop
//! per parameter over flat buffers.

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, Var};
use rayon::prelude::*;

use crate::backend::OptimizerSpec;
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
}

/// `tanh(√(2/π)·(x + a·x³))`: candle's GELU is `x/2·(1 + t)`.
fn gelu_tanh(x: f32) -> f32 {
    (SQRT_TWO_OVER_PI * x * (1.0 + GELU_A * x * x)).tanh()
}

/// The derivative of candle's tanh-approximated GELU at `x`, given `t = gelu_tanh(x)`.
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

/// Gradients of `sum(y ⊙ g)` for `y = ffn(x)`: `(dx, [dw1, db1, dw2, db2])`, and the time of
/// the recomputation and of the gradients.
pub(crate) fn ffn_gradients(
    p: &FfnVars,
    x: &Tensor,
    g: &Tensor,
) -> Result<(Tensor, [Tensor; 4], Duration, Duration)> {
    let started = Instant::now();
    let w1 = p.w1.as_tensor();
    let w2 = p.w2.as_tensor();
    let pre = x.matmul(&w1.t()?)?.broadcast_add(p.b1.as_tensor())?;
    let (rows, hidden) = pre.dims2()?;
    let pre_values = pre.flatten_all()?.to_vec1::<f32>()?;
    // One tanh per element, kept for the derivative; the elementwise passes run on every core
    // (at H=1024 the tanh alone cost about as much as a matrix product on one).
    let tanh: Vec<f32> = pre_values
        .par_iter()
        .with_min_len(PAR_MIN)
        .map(|&v| gelu_tanh(v))
        .collect();
    let h: Vec<f32> = pre_values
        .par_iter()
        .with_min_len(PAR_MIN)
        .zip(&tanh)
        .map(|(&v, &t)| 0.5 * v * (1.0 + t))
        .collect();
    let h = Tensor::from_vec(h, (rows, hidden), &Device::Cpu)?;
    let recomputed = Instant::now();
    let gt = g.t()?;
    let dw2 = gt.matmul(&h)?;
    let db2 = g.sum(0)?;
    let dh = g.matmul(w2)?.flatten_all()?.to_vec1::<f32>()?;
    let dpre: Vec<f32> = dh
        .par_iter()
        .with_min_len(PAR_MIN)
        .zip(pre_values.par_iter().zip(&tanh))
        .map(|(d, (&v, &t))| d * gelu_derivative(v, t))
        .collect();
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

/// AdamW over flat buffers: the same arithmetic as candle-nn's `AdamW` (PyTorch's), in one pass
/// per parameter.
pub(crate) struct FlatAdamW {
    spec: OptimizerSpec,
    moments: Vec<(Vec<f32>, Vec<f32>)>,
    step: u64,
}

impl FlatAdamW {
    /// State for `vars` (zero moments).
    pub fn new(spec: OptimizerSpec, vars: &[&Var]) -> Self {
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

    /// The hand-derived gradients equal candle's autograd on random data (rel. error < 1e-5).
    #[test]
    fn hand_derived_gradients_equal_autograd() {
        let mut rng = StdRng::seed_from_u64(1);
        let (dim, hidden, rows) = (24, 96, 37);
        let p = vars(&mut rng, dim, hidden);
        let x = Var::from_tensor(&randn(&[rows, dim], &mut rng)).unwrap();
        let g = randn(&[rows, dim], &mut rng);
        let y = x
            .as_tensor()
            .matmul(&p.w1.as_tensor().t().unwrap())
            .unwrap()
            .broadcast_add(p.b1.as_tensor())
            .unwrap()
            .gelu()
            .unwrap()
            .matmul(&p.w2.as_tensor().t().unwrap())
            .unwrap()
            .broadcast_add(p.b2.as_tensor())
            .unwrap();
        let auto = (y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let (dx, [dw1, db1, dw2, db2], _, _) = ffn_gradients(&p, x.as_tensor(), &g).unwrap();
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
        let spec = OptimizerSpec {
            lr: 1e-2,
            weight_decay: 0.1,
            ..OptimizerSpec::default()
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
