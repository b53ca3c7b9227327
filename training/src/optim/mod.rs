//! Optimizers over flat `f32` buffers, and learning-rate schedules.
//!
//! Every peer that takes a shared step must end with the same bits, so the update rules are plain
//! element-wise loops in index order: no threads, no reductions, no `mul_add`. Rust never contracts
//! `a * b + c` into a fused multiply-add by itself (not even with `-C target-cpu=native`), so the
//! scalar and auto-vectorised forms of a loop round identically. Hyper-parameters are `f64` (like
//! PyTorch's Python floats); per-step scalars (bias corrections, `lr / bc1`, `1 - lr * wd`) are
//! computed once in `f64` with basic operations only and rounded to `f32` before the loop, and
//! powers such as `beta1^t` use repeated squaring rather than the platform's `powi`.
//!
//! [`Sgd`] and [`AdamW`] follow PyTorch's `torch.optim.SGD` and `torch.optim.AdamW` (single-tensor,
//! non-AMSGrad) and name their state like PyTorch (`momentum_buffer`, `exp_avg`, `exp_avg_sq`).

mod adamw;
mod schedule;
mod sgd;

pub use adamw::{AdamW, AdamWConfig};
pub use schedule::LrSchedule;
pub use sgd::{Sgd, SgdConfig};

use serde::{Deserialize, Serialize};

use crate::params::ParamSet;

/// What went wrong when configuring or stepping an optimizer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptimError {
    /// The buffers handed to `step` do not have the length the optimizer was built for.
    #[error("optimizer holds state for {expected} values but got {params} parameters and {grads} gradients")]
    Length {
        /// The optimizer's length.
        expected: usize,
        /// Parameters given.
        params: usize,
        /// Gradients given.
        grads: usize,
    },
    /// A hyper-parameter is out of its range.
    #[error("invalid {kind} hyper-parameter: {reason}")]
    InvalidConfig {
        /// Optimizer kind (`"sgd"`, `"adamw"`).
        kind: &'static str,
        /// Which value and its valid range.
        reason: String,
    },
    /// A configuration for another kind of optimizer was given.
    #[error("cannot configure a {actual} optimizer with {expected} hyper-parameters")]
    KindMismatch {
        /// Kind of the configuration given.
        expected: &'static str,
        /// Kind of the optimizer.
        actual: &'static str,
    },
}

/// An optimizer that updates a flat parameter buffer from a flat gradient buffer.
///
/// State buffers have one value per parameter; [`Optimizer::state`] and [`Optimizer::state_mut`]
/// list them in a fixed order under names that depend only on the configuration, so checkpoints and
/// state sync can move them without knowing the optimizer.
///
/// ```
/// use starling_training::{AdamW, AdamWConfig, Optimizer};
/// let mut opt = AdamW::new(AdamWConfig::new(1e-3), 3)?;
/// let mut params = [0.5f32, -0.25, 1.0];
/// opt.step(&mut params, &[0.1, 0.2, -0.3])?;
/// assert_eq!(opt.steps(), 1);
/// let names: Vec<&str> = opt.state().iter().map(|(n, _)| *n).collect();
/// assert_eq!(names, ["exp_avg", "exp_avg_sq"]);
/// # Ok::<(), starling_training::OptimError>(())
/// ```
pub trait Optimizer: Send {
    /// Applies one update: `params` moves against `grads`; the step counter goes up by one.
    fn step(&mut self, params: &mut [f32], grads: &[f32]) -> Result<(), OptimError>;

    /// Number of parameters this optimizer keeps state for.
    fn len(&self) -> usize;

    /// Whether [`Optimizer::len`] is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Steps taken so far (PyTorch's `step`); AdamW's bias correction uses it.
    fn steps(&self) -> u64;

    /// Overwrites the step counter (when restoring a checkpoint or synced state).
    fn set_steps(&mut self, steps: u64);

    /// The current learning rate.
    fn lr(&self) -> f64;

    /// Changes the learning rate for the following steps (schedules call this before each step).
    fn set_lr(&mut self, lr: f64);

    /// Kind and hyper-parameters, as written to checkpoint metadata.
    fn config(&self) -> OptimizerConfig;

    /// Replaces the hyper-parameters; the kind must match. State buffers that the new
    /// configuration adds start at zero, those it drops are discarded.
    fn set_config(&mut self, config: &OptimizerConfig) -> Result<(), OptimError>;

    /// The state buffers, by name, in a fixed order.
    fn state(&self) -> Vec<(&'static str, &[f32])>;

    /// The state buffers, writable, in the order of [`Optimizer::state`].
    fn state_mut(&mut self) -> Vec<(&'static str, &mut [f32])>;

    /// [`Optimizer::step`] on a [`ParamSet`]'s parameters and gradients.
    ///
    /// ```
    /// use starling_training::{Optimizer, ParamSet, Sgd, SgdConfig};
    /// let mut set = ParamSet::new();
    /// set.add("w", &[2], &[1.0, 2.0])?;
    /// set.grads_mut().copy_from_slice(&[1.0, 1.0]);
    /// let mut sgd = Sgd::new(SgdConfig::new(0.5), set.len())?;
    /// sgd.step_set(&mut set)?;
    /// assert_eq!(set.params(), &[0.5, 1.5]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn step_set(&mut self, set: &mut ParamSet) -> Result<(), OptimError> {
        let (params, grads) = set.params_and_grads_mut();
        self.step(params, grads)
    }
}

/// Kind and hyper-parameters of an optimizer; serialises as `{"kind": "sgd" | "adamw", ...}`.
///
/// ```
/// use starling_training::{AdamWConfig, OptimizerConfig};
/// let config = OptimizerConfig::AdamW(AdamWConfig::new(3e-4).weight_decay(0.1));
/// let json = serde_json::to_string(&config).unwrap();
/// assert!(json.contains("\"kind\":\"adamw\""));
/// let mut opt = config.build(10)?;
/// assert_eq!(opt.lr(), 3e-4);
/// # Ok::<(), starling_training::OptimError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimizerConfig {
    /// [`Sgd`].
    Sgd(SgdConfig),
    /// [`AdamW`].
    AdamW(AdamWConfig),
}

impl OptimizerConfig {
    /// `"sgd"` or `"adamw"`.
    ///
    /// ```
    /// use starling_training::{OptimizerConfig, SgdConfig};
    /// assert_eq!(OptimizerConfig::Sgd(SgdConfig::default()).kind(), "sgd");
    /// ```
    pub fn kind(&self) -> &'static str {
        match self {
            OptimizerConfig::Sgd(_) => Sgd::KIND,
            OptimizerConfig::AdamW(_) => AdamW::KIND,
        }
    }

    /// The learning rate.
    ///
    /// ```
    /// use starling_training::{OptimizerConfig, SgdConfig};
    /// assert_eq!(OptimizerConfig::Sgd(SgdConfig::new(0.1)).lr(), 0.1);
    /// ```
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerConfig::Sgd(c) => c.lr,
            OptimizerConfig::AdamW(c) => c.lr,
        }
    }

    /// Checks every hyper-parameter against its range.
    ///
    /// ```
    /// use starling_training::{OptimizerConfig, SgdConfig};
    /// assert!(OptimizerConfig::Sgd(SgdConfig::new(-1.0)).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), OptimError> {
        match self {
            OptimizerConfig::Sgd(c) => c.validate(),
            OptimizerConfig::AdamW(c) => c.validate(),
        }
    }

    /// A fresh optimizer of this kind for `len` parameters.
    ///
    /// ```
    /// use starling_training::{OptimizerConfig, SgdConfig};
    /// let opt = OptimizerConfig::Sgd(SgdConfig::new(0.1).momentum(0.9)).build(4)?;
    /// assert_eq!(opt.state()[0].0, "momentum_buffer");
    /// # Ok::<(), starling_training::OptimError>(())
    /// ```
    pub fn build(&self, len: usize) -> Result<Box<dyn Optimizer>, OptimError> {
        Ok(match self {
            OptimizerConfig::Sgd(c) => Box::new(Sgd::new(*c, len)?),
            OptimizerConfig::AdamW(c) => Box::new(AdamW::new(*c, len)?),
        })
    }
}

/// Checks the three buffer lengths of a step.
fn check_lengths(expected: usize, params: &[f32], grads: &[f32]) -> Result<(), OptimError> {
    if params.len() != expected || grads.len() != expected {
        return Err(OptimError::Length {
            expected,
            params: params.len(),
            grads: grads.len(),
        });
    }
    Ok(())
}

/// `base^exp` by repeated squaring: only multiplications, so the same bits on every platform.
fn powu(base: f64, mut exp: u64) -> f64 {
    let mut result = 1.0;
    let mut b = base;
    while exp > 0 {
        if exp & 1 == 1 {
            result *= b;
        }
        b *= b;
        exp >>= 1;
    }
    result
}

/// Fails with a readable reason unless `ok`.
fn require(
    kind: &'static str,
    ok: bool,
    reason: impl FnOnce() -> String,
) -> Result<(), OptimError> {
    if ok {
        Ok(())
    } else {
        Err(OptimError::InvalidConfig {
            kind,
            reason: reason(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn powu_matches_powi_closely() {
        for &b in &[0.9f64, 0.999, 0.5, 1.0, 0.0] {
            for t in [0u64, 1, 2, 3, 10, 1000, 123_457] {
                let want = b.powi(t as i32);
                let got = powu(b, t);
                assert!(
                    (got - want).abs() <= 1e-13 * want.abs().max(1e-300),
                    "{b}^{t}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn config_json_round_trips_exactly() {
        // Values whose shortest decimal needs all 17 digits.
        let c = OptimizerConfig::AdamW(AdamWConfig {
            lr: 0.1 + 0.2,
            beta1: 0.9 - 1e-17,
            beta2: 1.0 - 1.0 / 3.0 * 1e-3,
            eps: 1e-8 / 3.0,
            weight_decay: std::f64::consts::PI * 1e-3,
        });
        let json = serde_json::to_string(&c).unwrap();
        let back: OptimizerConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c);
        if let (OptimizerConfig::AdamW(a), OptimizerConfig::AdamW(b)) = (c, back) {
            assert_eq!(a.lr.to_bits(), b.lr.to_bits());
            assert_eq!(a.beta2.to_bits(), b.beta2.to_bits());
            assert_eq!(a.eps.to_bits(), b.eps.to_bits());
        }
        let s = OptimizerConfig::Sgd(SgdConfig::new(1.0 / 7.0).momentum(0.9).nesterov(true));
        let back: OptimizerConfig =
            serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn set_config_refuses_another_kind() {
        let mut sgd = Sgd::new(SgdConfig::new(0.1), 2).unwrap();
        let err = sgd
            .set_config(&OptimizerConfig::AdamW(AdamWConfig::default()))
            .unwrap_err();
        assert_eq!(
            err,
            OptimError::KindMismatch {
                expected: "adamw",
                actual: "sgd"
            }
        );
    }
}
