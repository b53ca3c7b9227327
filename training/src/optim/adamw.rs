//! Adam with decoupled weight decay (Loshchilov & Hutter), as `torch.optim.AdamW` computes it.

use serde::{Deserialize, Serialize};

use super::{check_lengths, powu, require, OptimError, Optimizer, OptimizerConfig};

/// Hyper-parameters of [`AdamW`], with PyTorch's defaults (`lr` 1e-3, betas 0.9/0.999, `eps` 1e-8,
/// `weight_decay` 1e-2).
///
/// ```
/// use starling_training::AdamWConfig;
/// let c = AdamWConfig::new(3e-4).betas(0.9, 0.95).eps(1e-6).weight_decay(0.1);
/// assert_eq!((c.beta2, c.eps), (0.95, 1e-6));
/// assert!(c.validate().is_ok());
/// assert!(AdamWConfig::new(1e-3).betas(1.0, 0.999).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Decay of the first moment, in `[0, 1)`.
    pub beta1: f64,
    /// Decay of the second moment, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the denominator (> 0).
    pub eps: f64,
    /// Decoupled weight decay (`p *= 1 - lr * weight_decay`), >= 0.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

impl AdamWConfig {
    /// Defaults with the given learning rate.
    ///
    /// ```
    /// assert_eq!(starling_training::AdamWConfig::new(3e-4).lr, 3e-4);
    /// ```
    pub fn new(lr: f64) -> Self {
        Self {
            lr,
            ..Self::default()
        }
    }

    /// Sets both moment decays.
    ///
    /// ```
    /// let c = starling_training::AdamWConfig::new(1e-3).betas(0.8, 0.99);
    /// assert_eq!((c.beta1, c.beta2), (0.8, 0.99));
    /// ```
    pub fn betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.beta1 = beta1;
        self.beta2 = beta2;
        self
    }

    /// Sets `eps`.
    ///
    /// ```
    /// assert_eq!(starling_training::AdamWConfig::new(1e-3).eps(1e-6).eps, 1e-6);
    /// ```
    pub fn eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Sets the decoupled weight decay.
    ///
    /// ```
    /// assert_eq!(starling_training::AdamWConfig::new(1e-3).weight_decay(0.0).weight_decay, 0.0);
    /// ```
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Checks every value against its range.
    ///
    /// ```
    /// assert!(starling_training::AdamWConfig::new(1e-3).eps(0.0).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), OptimError> {
        let k = AdamW::KIND;
        require(k, self.lr.is_finite() && self.lr >= 0.0, || {
            format!("lr {} must be finite and >= 0", self.lr)
        })?;
        require(k, (0.0..1.0).contains(&self.beta1), || {
            format!("beta1 {} must be in [0, 1)", self.beta1)
        })?;
        require(k, (0.0..1.0).contains(&self.beta2), || {
            format!("beta2 {} must be in [0, 1)", self.beta2)
        })?;
        require(k, self.eps.is_finite() && self.eps > 0.0, || {
            format!("eps {} must be finite and > 0", self.eps)
        })?;
        require(
            k,
            self.weight_decay.is_finite() && self.weight_decay >= 0.0,
            || format!("weight_decay {} must be finite and >= 0", self.weight_decay),
        )
    }
}

/// AdamW as `torch.optim.AdamW` (single-tensor, non-AMSGrad) computes it. At step `t` (from 1),
/// with the scalars computed in `f64` and rounded to `f32` once:
///
/// ```text
/// p = p * (1 - lr * weight_decay)
/// m = beta1 * m + (1 - beta1) * g
/// v = beta2 * v + (1 - beta2) * g * g
/// p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
/// ```
///
/// ```
/// use starling_training::{AdamW, AdamWConfig, Optimizer};
/// let mut opt = AdamW::new(AdamWConfig::new(0.1).weight_decay(0.1), 1)?;
/// let mut p = [1.0f32];
/// opt.step(&mut p, &[0.5])?;
/// // First step: p * (1 - 0.01) - 0.1 * g / (|g| + eps) = 0.99 - 0.1 (to 1e-7)
/// assert!((p[0] - 0.89).abs() < 1e-6);
/// # Ok::<(), starling_training::OptimError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct AdamW {
    config: AdamWConfig,
    steps: u64,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
}

impl AdamW {
    /// The kind written to checkpoints.
    pub const KIND: &'static str = "adamw";

    /// A fresh optimizer for `len` parameters (both moments start at zero).
    ///
    /// ```
    /// use starling_training::{AdamW, AdamWConfig, Optimizer};
    /// let opt = AdamW::new(AdamWConfig::default(), 4)?;
    /// assert_eq!(opt.state()[1], ("exp_avg_sq", &[0.0f32; 4][..]));
    /// # Ok::<(), starling_training::OptimError>(())
    /// ```
    pub fn new(config: AdamWConfig, len: usize) -> Result<Self, OptimError> {
        config.validate()?;
        Ok(Self {
            config,
            steps: 0,
            exp_avg: vec![0.0; len],
            exp_avg_sq: vec![0.0; len],
        })
    }

    /// The hyper-parameters.
    ///
    /// ```
    /// use starling_training::{AdamW, AdamWConfig};
    /// let opt = AdamW::new(AdamWConfig::new(0.01), 4)?;
    /// assert_eq!(opt.adamw_config().lr, 0.01);
    /// # Ok::<(), starling_training::OptimError>(())
    /// ```
    pub fn adamw_config(&self) -> &AdamWConfig {
        &self.config
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, params: &mut [f32], grads: &[f32]) -> Result<(), OptimError> {
        check_lengths(self.exp_avg.len(), params, grads)?;
        let c = &self.config;
        let t = self.steps + 1;
        let bias_correction1 = 1.0 - powu(c.beta1, t);
        let bias_correction2 = 1.0 - powu(c.beta2, t);
        let step_size = (c.lr / bias_correction1) as f32;
        let bc2_sqrt = bias_correction2.sqrt() as f32;
        let decay = (1.0 - c.lr * c.weight_decay) as f32;
        let beta1 = c.beta1 as f32;
        let beta2 = c.beta2 as f32;
        let one_minus_beta1 = (1.0 - c.beta1) as f32;
        let one_minus_beta2 = (1.0 - c.beta2) as f32;
        let eps = c.eps as f32;
        let moments = self.exp_avg.iter_mut().zip(self.exp_avg_sq.iter_mut());
        for ((p, &g), (m, v)) in params.iter_mut().zip(grads).zip(moments) {
            let decayed = *p * decay;
            *m = beta1 * *m + one_minus_beta1 * g;
            // Never below zero: a state averaged with a lossy codec (or loaded from elsewhere)
            // can hold small negative second moments, whose square root would make the
            // parameter NaN. (For any state Adam itself produces this changes no bit.)
            *v = (beta2 * *v + one_minus_beta2 * g * g).max(0.0);
            let denom = v.sqrt() / bc2_sqrt + eps;
            *p = decayed - step_size * *m / denom;
        }
        self.steps = t;
        Ok(())
    }

    fn len(&self) -> usize {
        self.exp_avg.len()
    }

    fn steps(&self) -> u64 {
        self.steps
    }

    fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    fn config(&self) -> OptimizerConfig {
        OptimizerConfig::AdamW(self.config)
    }

    fn set_config(&mut self, config: &OptimizerConfig) -> Result<(), OptimError> {
        let OptimizerConfig::AdamW(c) = config else {
            return Err(OptimError::KindMismatch {
                expected: config.kind(),
                actual: Self::KIND,
            });
        };
        c.validate()?;
        self.config = *c;
        Ok(())
    }

    fn state(&self) -> Vec<(&'static str, &[f32])> {
        vec![
            ("exp_avg", &self.exp_avg[..]),
            ("exp_avg_sq", &self.exp_avg_sq[..]),
        ]
    }

    fn state_mut(&mut self) -> Vec<(&'static str, &mut [f32])> {
        vec![
            ("exp_avg", &mut self.exp_avg[..]),
            ("exp_avg_sq", &mut self.exp_avg_sq[..]),
        ]
    }
}
