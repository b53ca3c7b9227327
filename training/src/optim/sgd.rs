//! Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay.

use serde::{Deserialize, Serialize};

use super::{check_lengths, require, OptimError, Optimizer, OptimizerConfig};

/// Hyper-parameters of [`Sgd`], with PyTorch's meaning and defaults (`lr` 1e-3, everything else off).
///
/// ```
/// use starling_training::SgdConfig;
/// let c = SgdConfig::new(0.1).momentum(0.9).nesterov(true).weight_decay(1e-4);
/// assert_eq!((c.lr, c.momentum, c.nesterov), (0.1, 0.9, true));
/// assert!(c.validate().is_ok());
/// assert!(SgdConfig::new(0.1).nesterov(true).validate().is_err()); // Nesterov needs momentum
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Momentum factor in `[0, 1)`; 0 keeps no state.
    pub momentum: f64,
    /// Dampening of the gradient added to the momentum buffer, in `[0, 1]`.
    pub dampening: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
    /// L2 penalty added to the gradient (`g + weight_decay * p`), >= 0. With `sign`, decoupled
    /// instead: `p -= lr * (sign(d) + weight_decay * p)`.
    pub weight_decay: f64,
    /// Step by the sign of the direction (signSGD; with momentum, signum): every parameter
    /// moves by `lr` (0 where the direction is exactly 0). Paired with a DCT top-k compressor
    /// that keeps a momentum (`starling_compression::dct::DctTopK::momentum`), this is DeMo.
    #[serde(default)]
    pub sign: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            sign: false,
        }
    }
}

impl SgdConfig {
    /// Defaults with the given learning rate.
    ///
    /// ```
    /// assert_eq!(starling_training::SgdConfig::new(0.5).lr, 0.5);
    /// ```
    pub fn new(lr: f64) -> Self {
        Self {
            lr,
            ..Self::default()
        }
    }

    /// Sets the momentum factor.
    ///
    /// ```
    /// assert_eq!(starling_training::SgdConfig::new(0.1).momentum(0.9).momentum, 0.9);
    /// ```
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// Sets the dampening.
    ///
    /// ```
    /// assert_eq!(starling_training::SgdConfig::new(0.1).dampening(0.5).dampening, 0.5);
    /// ```
    pub fn dampening(mut self, dampening: f64) -> Self {
        self.dampening = dampening;
        self
    }

    /// Turns Nesterov momentum on or off.
    ///
    /// ```
    /// assert!(starling_training::SgdConfig::new(0.1).momentum(0.9).nesterov(true).nesterov);
    /// ```
    pub fn nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }

    /// Steps by the sign of the direction (see [`SgdConfig::sign`]).
    ///
    /// ```
    /// use starling_training::{Optimizer, Sgd, SgdConfig};
    /// let mut opt = Sgd::new(SgdConfig::new(0.01).sign(true), 3)?;
    /// let mut p = [1.0f32, 1.0, 1.0];
    /// opt.step(&mut p, &[0.5, -2e-6, 0.0])?;
    /// assert_eq!(p, [0.99, 1.01, 1.0]);
    /// # Ok::<(), starling_training::OptimError>(())
    /// ```
    pub fn sign(mut self, sign: bool) -> Self {
        self.sign = sign;
        self
    }

    /// Sets the L2 weight decay.
    ///
    /// ```
    /// assert_eq!(starling_training::SgdConfig::new(0.1).weight_decay(1e-4).weight_decay, 1e-4);
    /// ```
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Checks every value against its range.
    ///
    /// ```
    /// assert!(starling_training::SgdConfig::new(0.1).momentum(1.5).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), OptimError> {
        let k = Sgd::KIND;
        require(k, self.lr.is_finite() && self.lr >= 0.0, || {
            format!("lr {} must be finite and >= 0", self.lr)
        })?;
        require(k, (0.0..1.0).contains(&self.momentum), || {
            format!("momentum {} must be in [0, 1)", self.momentum)
        })?;
        require(k, (0.0..=1.0).contains(&self.dampening), || {
            format!("dampening {} must be in [0, 1]", self.dampening)
        })?;
        require(
            k,
            self.weight_decay.is_finite() && self.weight_decay >= 0.0,
            || format!("weight_decay {} must be finite and >= 0", self.weight_decay),
        )?;
        require(
            k,
            !self.nesterov || (self.momentum > 0.0 && self.dampening == 0.0),
            || "nesterov needs momentum > 0 and dampening 0".to_string(),
        )
    }
}

/// SGD as `torch.optim.SGD` computes it, per element in `f32`:
///
/// ```text
/// d = g + weight_decay * p
/// buf = d                                         (first step)
/// buf = momentum * buf + (1 - dampening) * d      (later steps)
/// d = d + momentum * buf   (Nesterov)   or   d = buf
/// p = p - lr * d
/// ```
///
/// With `momentum == 0` there is no buffer and `d` is used directly.
///
/// ```
/// use starling_training::{Optimizer, Sgd, SgdConfig};
/// let mut sgd = Sgd::new(SgdConfig::new(0.1).momentum(0.9), 1)?;
/// let mut p = [1.0f32];
/// sgd.step(&mut p, &[0.5])?; // buf = 0.5,  p = 1 - 0.05
/// sgd.step(&mut p, &[0.5])?; // buf = 0.95, p = 0.95 - 0.095
/// assert!((p[0] - 0.855).abs() < 1e-6);
/// # Ok::<(), starling_training::OptimError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Sgd {
    config: SgdConfig,
    len: usize,
    steps: u64,
    /// Empty when `momentum == 0`.
    momentum_buffer: Vec<f32>,
}

impl Sgd {
    /// The kind written to checkpoints.
    pub const KIND: &'static str = "sgd";

    /// A fresh optimizer for `len` parameters.
    ///
    /// ```
    /// use starling_training::{Optimizer, Sgd, SgdConfig};
    /// let sgd = Sgd::new(SgdConfig::new(0.1), 8)?;
    /// assert_eq!((sgd.len(), sgd.steps()), (8, 0));
    /// # Ok::<(), starling_training::OptimError>(())
    /// ```
    pub fn new(config: SgdConfig, len: usize) -> Result<Self, OptimError> {
        config.validate()?;
        let mut sgd = Self {
            config,
            len,
            steps: 0,
            momentum_buffer: Vec::new(),
        };
        sgd.fit_state();
        Ok(sgd)
    }

    /// The hyper-parameters.
    ///
    /// ```
    /// use starling_training::{Sgd, SgdConfig};
    /// let sgd = Sgd::new(SgdConfig::new(0.1), 8)?;
    /// assert_eq!(sgd.sgd_config().lr, 0.1);
    /// # Ok::<(), starling_training::OptimError>(())
    /// ```
    pub fn sgd_config(&self) -> &SgdConfig {
        &self.config
    }

    /// Allocates or drops the momentum buffer to match the configuration.
    fn fit_state(&mut self) {
        if self.config.momentum != 0.0 {
            self.momentum_buffer.resize(self.len, 0.0);
        } else {
            self.momentum_buffer = Vec::new();
        }
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &mut [f32], grads: &[f32]) -> Result<(), OptimError> {
        check_lengths(self.len, params, grads)?;
        let c = &self.config;
        let lr = c.lr as f32;
        let wd = c.weight_decay as f32;
        let momentum = c.momentum as f32;
        let keep = (1.0 - c.dampening) as f32;
        let first = self.steps == 0;
        // The update from a direction `d`: `lr * d`, or with `sign` `lr * (sign(d) + wd * p)`
        // (decoupled decay, so not also in the direction).
        let sign = c.sign;
        let update = |p: f32, d: f32| {
            if sign {
                let s = if d > 0.0 {
                    1.0
                } else if d < 0.0 {
                    -1.0
                } else {
                    0.0
                };
                lr * (s + wd * p)
            } else {
                lr * d
            }
        };
        let l2 = if sign { 0.0 } else { wd };
        if momentum == 0.0 {
            for (p, &g) in params.iter_mut().zip(grads) {
                let d = if l2 != 0.0 { g + l2 * *p } else { g };
                *p -= update(*p, d);
            }
        } else {
            let bufs = &mut self.momentum_buffer;
            for ((p, &g), buf) in params.iter_mut().zip(grads).zip(bufs.iter_mut()) {
                let d = if l2 != 0.0 { g + l2 * *p } else { g };
                let b = if first { d } else { momentum * *buf + keep * d };
                *buf = b;
                let d = if c.nesterov { d + momentum * b } else { b };
                *p -= update(*p, d);
            }
        }
        self.steps += 1;
        Ok(())
    }

    fn len(&self) -> usize {
        self.len
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
        OptimizerConfig::Sgd(self.config)
    }

    fn set_config(&mut self, config: &OptimizerConfig) -> Result<(), OptimError> {
        let OptimizerConfig::Sgd(c) = config else {
            return Err(OptimError::KindMismatch {
                expected: config.kind(),
                actual: Self::KIND,
            });
        };
        c.validate()?;
        self.config = *c;
        self.fit_state();
        Ok(())
    }

    fn state(&self) -> Vec<(&'static str, &[f32])> {
        if self.config.momentum != 0.0 {
            vec![("momentum_buffer", &self.momentum_buffer[..])]
        } else {
            Vec::new()
        }
    }

    fn state_mut(&mut self) -> Vec<(&'static str, &mut [f32])> {
        if self.config.momentum != 0.0 {
            vec![("momentum_buffer", &mut self.momentum_buffer[..])]
        } else {
            Vec::new()
        }
    }
}
