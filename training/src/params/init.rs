//! Seeded initialisers for the values of a tensor.

use rand::Rng;

use super::ParamError;

/// How to fill a tensor's initial values. Fans come from the shape as in PyTorch: for a shape
/// `[out, in, k...]`, `fan_in = in * prod(k)` and `fan_out = out * prod(k)`; those variants need a
/// rank of at least 2 (use [`Init::torch_bias`] or [`Init::Uniform`] for biases).
///
/// ```
/// use rand::{rngs::StdRng, SeedableRng};
/// use starling_training::Init;
/// let mut w = vec![0.0f32; 6 * 24];
/// Init::KaimingUniform.fill("w", &[6, 24], &mut w, &mut StdRng::seed_from_u64(0))?;
/// let bound = (6.0f32 / 24.0).sqrt();
/// assert!(w.iter().all(|v| v.abs() <= bound));
/// # Ok::<(), starling_training::ParamError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// Every value the same.
    Constant(f32),
    /// Uniform on `[low, high)`.
    Uniform {
        /// Lower bound (inclusive).
        low: f32,
        /// Upper bound.
        high: f32,
    },
    /// Normal (Box–Muller from the RNG's `f64`s).
    Normal {
        /// Mean.
        mean: f32,
        /// Standard deviation.
        std: f32,
    },
    /// He/Kaiming uniform for ReLU: `U(-b, b)` with `b = sqrt(6 / fan_in)`.
    KaimingUniform,
    /// He/Kaiming normal for ReLU: `N(0, 2 / fan_in)`.
    KaimingNormal,
    /// Glorot/Xavier uniform: `U(-b, b)` with `b = sqrt(6 / (fan_in + fan_out))`.
    XavierUniform,
    /// PyTorch's default for `nn.Linear`/`nn.ConvNd` weights: `U(-b, b)` with `b = 1 / sqrt(fan_in)`.
    TorchLinear,
}

impl Init {
    /// PyTorch's default for a bias whose layer has `fan_in` inputs: `U(-b, b)`, `b = 1 / sqrt(fan_in)`.
    ///
    /// ```
    /// let init = starling_training::Init::torch_bias(4);
    /// assert_eq!(init, starling_training::Init::Uniform { low: -0.5, high: 0.5 });
    /// ```
    pub fn torch_bias(fan_in: usize) -> Init {
        let b = (1.0 / (fan_in.max(1) as f64).sqrt()) as f32;
        Init::Uniform { low: -b, high: b }
    }

    /// Fills `out` (the values of tensor `name` with `shape`) from `rng`, in order.
    ///
    /// ```
    /// use rand::{rngs::StdRng, SeedableRng};
    /// let mut out = vec![0.0f32; 4];
    /// starling_training::Init::Constant(0.5).fill("b", &[4], &mut out, &mut StdRng::seed_from_u64(0))?;
    /// assert_eq!(out, [0.5; 4]);
    /// // Kaiming needs a fan-in, which a rank-1 shape does not give.
    /// assert!(starling_training::Init::KaimingNormal.fill("b", &[4], &mut out, &mut StdRng::seed_from_u64(0)).is_err());
    /// # Ok::<(), starling_training::ParamError>(())
    /// ```
    pub fn fill<R: Rng + ?Sized>(
        self,
        name: &str,
        shape: &[usize],
        out: &mut [f32],
        rng: &mut R,
    ) -> Result<(), ParamError> {
        let invalid = |reason: String| ParamError::InvalidInit {
            name: name.to_string(),
            shape: shape.to_vec(),
            reason,
        };
        let fans = || {
            fans(shape).ok_or_else(|| invalid(format!("{self:?} needs a shape of rank >= 2 with non-zero fans; use Init::torch_bias or Init::Uniform for biases")))
        };
        match self {
            Init::Zeros => out.fill(0.0),
            Init::Constant(v) => out.fill(v),
            Init::Uniform { low, high } => {
                if !(low.is_finite() && high.is_finite() && low <= high) {
                    return Err(invalid(format!(
                        "uniform bounds [{low}, {high}) are not a finite interval"
                    )));
                }
                fill_uniform(out, low, high, rng);
            }
            Init::Normal { mean, std } => {
                if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
                    return Err(invalid(format!(
                        "normal(mean {mean}, std {std}) needs finite values and std >= 0"
                    )));
                }
                fill_normal(out, f64::from(mean), f64::from(std), rng);
            }
            Init::KaimingUniform => {
                let (fan_in, _) = fans()?;
                let b = (6.0 / fan_in as f64).sqrt() as f32;
                fill_uniform(out, -b, b, rng);
            }
            Init::KaimingNormal => {
                let (fan_in, _) = fans()?;
                fill_normal(out, 0.0, (2.0 / fan_in as f64).sqrt(), rng);
            }
            Init::XavierUniform => {
                let (fan_in, fan_out) = fans()?;
                let b = (6.0 / (fan_in + fan_out) as f64).sqrt() as f32;
                fill_uniform(out, -b, b, rng);
            }
            Init::TorchLinear => {
                let (fan_in, _) = fans()?;
                let b = (1.0 / (fan_in as f64).sqrt()) as f32;
                fill_uniform(out, -b, b, rng);
            }
        }
        Ok(())
    }
}

/// PyTorch's `(fan_in, fan_out)`; `None` below rank 2 or with a zero fan.
fn fans(shape: &[usize]) -> Option<(usize, usize)> {
    if shape.len() < 2 {
        return None;
    }
    let receptive: usize = shape[2..].iter().product();
    let fan_in = shape[1] * receptive;
    let fan_out = shape[0] * receptive;
    (fan_in > 0 && fan_out > 0).then_some((fan_in, fan_out))
}

fn fill_uniform<R: Rng + ?Sized>(out: &mut [f32], low: f32, high: f32, rng: &mut R) {
    let width = high - low;
    for v in out {
        // `gen::<f32>()` is in [0, 1); rounding can still land on `high`, so clamp below it.
        let x = low + width * rng.gen::<f32>();
        *v = if x >= high && width > 0.0 {
            low.max(high.next_down())
        } else {
            x
        };
    }
}

fn fill_normal<R: Rng + ?Sized>(out: &mut [f32], mean: f64, std: f64, rng: &mut R) {
    let mut chunks = out.chunks_mut(2);
    for pair in &mut chunks {
        // u1 in (0, 1] keeps ln finite.
        let u1 = 1.0 - rng.gen::<f64>();
        let u2 = rng.gen::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = std::f64::consts::TAU * u2;
        pair[0] = (mean + std * r * theta.cos()) as f32;
        if let Some(second) = pair.get_mut(1) {
            *second = (mean + std * r * theta.sin()) as f32;
        }
    }
}
