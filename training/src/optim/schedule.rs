//! Learning-rate schedules that every peer evaluates to the same bits.

use serde::{Deserialize, Serialize};

use super::{require, OptimError, Optimizer};

/// A learning rate as a function of the number of optimizer steps already taken.
///
/// `lr_at(s)` is the rate for the step that takes the counter from `s` to `s + 1`, so call
/// `opt.set_lr(schedule.lr_at(opt.steps()))` before each step. The cosine is a fixed Taylor
/// series in `f64` (basic operations only), not the platform's `cos`, so peers on different
/// platforms agree on every bit.
///
/// ```
/// use starling_training::LrSchedule;
/// let s = LrSchedule::WarmupCosine { peak_lr: 1e-3, min_lr: 1e-5, warmup_steps: 100, total_steps: 1000 };
/// assert!((s.lr_at(0) - 1e-5).abs() < 1e-18); // warmup starts at peak / warmup_steps
/// assert!((s.lr_at(99) - 1e-3).abs() < 1e-18); // and reaches the peak on its last step
/// assert!((s.lr_at(550) - (1e-3 + 1e-5) / 2.0).abs() < 1e-12); // half way down
/// assert_eq!(s.lr_at(5000), 1e-5);         // after the end: min_lr
/// assert_eq!(LrSchedule::Constant { lr: 0.1 }.lr_at(7), 0.1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LrSchedule {
    /// The same rate on every step.
    Constant {
        /// Learning rate.
        lr: f64,
    },
    /// Linear warmup from `peak_lr / warmup_steps` to `peak_lr` over `warmup_steps` steps, then a
    /// half cosine from `peak_lr` to `min_lr` that ends at `total_steps`; `min_lr` after that.
    WarmupCosine {
        /// Rate at the end of warmup.
        peak_lr: f64,
        /// Rate at and after `total_steps`.
        min_lr: f64,
        /// Steps of linear warmup (0: start at the peak).
        warmup_steps: u64,
        /// Step at which the decay ends (>= `warmup_steps`).
        total_steps: u64,
    },
}

impl LrSchedule {
    /// The learning rate for the step taken after `step` steps.
    ///
    /// ```
    /// use starling_training::LrSchedule;
    /// let s = LrSchedule::WarmupCosine { peak_lr: 1.0, min_lr: 0.0, warmup_steps: 4, total_steps: 8 };
    /// let lrs: Vec<f64> = (0..4).map(|t| s.lr_at(t)).collect();
    /// assert_eq!(lrs, [0.25, 0.5, 0.75, 1.0]);
    /// ```
    pub fn lr_at(&self, step: u64) -> f64 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupCosine {
                peak_lr,
                min_lr,
                warmup_steps,
                total_steps,
            } => {
                if step < warmup_steps {
                    return peak_lr * (step + 1) as f64 / warmup_steps as f64;
                }
                if step >= total_steps {
                    return min_lr;
                }
                let progress = (step - warmup_steps) as f64 / (total_steps - warmup_steps) as f64;
                min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + cos_pi(progress))
            }
        }
    }

    /// Sets `opt`'s learning rate for its next step and returns it.
    ///
    /// ```
    /// use starling_training::{LrSchedule, Optimizer, Sgd, SgdConfig};
    /// let mut opt = Sgd::new(SgdConfig::new(0.0), 1)?;
    /// let s = LrSchedule::WarmupCosine { peak_lr: 0.4, min_lr: 0.0, warmup_steps: 2, total_steps: 10 };
    /// let mut p = [0.0f32];
    /// assert_eq!(s.apply(&mut opt), 0.2);
    /// opt.step(&mut p, &[1.0])?;
    /// assert_eq!(s.apply(&mut opt), 0.4);
    /// # Ok::<(), starling_training::OptimError>(())
    /// ```
    pub fn apply(&self, opt: &mut dyn Optimizer) -> f64 {
        let lr = self.lr_at(opt.steps());
        opt.set_lr(lr);
        lr
    }

    /// Checks the rates and step counts.
    ///
    /// ```
    /// use starling_training::LrSchedule;
    /// let bad = LrSchedule::WarmupCosine { peak_lr: 1.0, min_lr: 0.0, warmup_steps: 10, total_steps: 5 };
    /// assert!(bad.validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), OptimError> {
        let k = "schedule";
        match *self {
            LrSchedule::Constant { lr } => require(k, lr.is_finite() && lr >= 0.0, || {
                format!("lr {lr} must be finite and >= 0")
            }),
            LrSchedule::WarmupCosine {
                peak_lr,
                min_lr,
                warmup_steps,
                total_steps,
            } => {
                require(k, peak_lr.is_finite() && min_lr.is_finite(), || {
                    format!("rates {peak_lr}, {min_lr} must be finite")
                })?;
                require(k, 0.0 <= min_lr && min_lr <= peak_lr, || {
                    format!("need 0 <= min_lr ({min_lr}) <= peak_lr ({peak_lr})")
                })?;
                require(k, warmup_steps <= total_steps, || {
                    format!("warmup_steps {warmup_steps} exceeds total_steps {total_steps}")
                })
            }
        }
    }
}

/// `cos(pi * x)` for `x` in `[0, 1]` by a Taylor series on `[0, pi/2]`: basic operations only,
/// absolute error below 1e-15.
fn cos_pi(x: f64) -> f64 {
    let x = x.clamp(0.0, 1.0);
    // cos(pi x) = -cos(pi (1 - x)) folds [1/2, 1] onto [0, 1/2].
    let (x, sign) = if x > 0.5 { (1.0 - x, -1.0) } else { (x, 1.0) };
    let y = std::f64::consts::PI * x;
    let y2 = y * y;
    let mut term = 1.0;
    let mut sum = 1.0;
    // (pi/2)^28 / 28! < 1e-19: fourteen terms exhaust f64 precision.
    for k in 1..=14u32 {
        let k = f64::from(k);
        term *= -y2 / ((2.0 * k - 1.0) * (2.0 * k));
        sum += term;
    }
    sign * sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cos_pi_matches_std_cos() {
        for i in 0..=10_000 {
            let x = f64::from(i) / 10_000.0;
            let want = (std::f64::consts::PI * x).cos();
            assert!((cos_pi(x) - want).abs() < 1e-15, "x = {x}");
        }
    }

    #[test]
    fn warmup_cosine_is_monotone_and_continuous() {
        let s = LrSchedule::WarmupCosine {
            peak_lr: 3e-4,
            min_lr: 3e-5,
            warmup_steps: 50,
            total_steps: 500,
        };
        let lrs: Vec<f64> = (0..600).map(|t| s.lr_at(t)).collect();
        assert!(lrs[..50].windows(2).all(|w| w[0] < w[1]));
        assert!(lrs[49..500].windows(2).all(|w| w[0] >= w[1]));
        assert_eq!(lrs[50], 3e-4);
        assert!((lrs[499] - 3e-5) < 1e-8);
        assert!(lrs[500..].iter().all(|&lr| lr == 3e-5));
        assert!(s.validate().is_ok());
    }

    #[test]
    fn no_warmup_starts_at_peak() {
        let s = LrSchedule::WarmupCosine {
            peak_lr: 1.0,
            min_lr: 0.0,
            warmup_steps: 0,
            total_steps: 0,
        };
        assert_eq!(s.lr_at(0), 0.0); // total 0: already past the end
        let s = LrSchedule::WarmupCosine {
            peak_lr: 1.0,
            min_lr: 0.0,
            warmup_steps: 0,
            total_steps: 4,
        };
        assert_eq!(s.lr_at(0), 1.0);
        assert!((s.lr_at(2) - 0.5).abs() < 1e-15);
    }
}
