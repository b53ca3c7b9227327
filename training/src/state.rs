//! A peer's training state, borrowed: what a checkpoint saves ([`StateView::save`]) and a state
//! sync donor serves ([`StateView::capture`]), and where a checkpoint is loaded
//! ([`StateTarget::load`]) or a synced state written ([`StateTarget::apply`]). One builder per
//! side for both: parameters, named optimizers, named extra buffers (one value per parameter),
//! and (on the saving side) the epoch and named counters.
//!
//! ```
//! use starling_training::state::{StateTarget, StateView};
//! use starling_training::{ParamSet, Sgd, SgdConfig};
//! let dir = tempfile::tempdir().unwrap();
//! let mut params = ParamSet::new();
//! params.add("w", &[2], &[0.5, -0.5])?;
//! let sgd = Sgd::new(SgdConfig::new(0.1).momentum(0.9), params.len())?;
//! let view = StateView::new(7, &params).optimizer("opt", &sgd).counter("samples", 64);
//! view.save(dir.path())?; // a checkpoint
//! let served = view.capture()?; // what a state sync donor serves
//! assert_eq!(served.epoch(), 7);
//!
//! let mut resumed = ParamSet::new();
//! resumed.add_zeros("w", &[2])?;
//! let mut resumed_sgd = Sgd::new(SgdConfig::default(), resumed.len())?;
//! let meta = StateTarget::new(&mut resumed).optimizer("opt", &mut resumed_sgd).load(dir.path())?;
//! assert_eq!((meta.epoch, resumed.params()), (7, params.params()));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::BTreeMap;

use crate::optim::Optimizer;
use crate::params::ParamSet;

/// A donor's training state, borrowed, at a step boundary: parameters, optimizers, extra
/// buffers, epoch and counters. [`StateView::capture`] copies it into a [`StateSnapshot`](crate::sync::StateSnapshot) for a
/// [`StateServer`](super::StateServer).
///
/// ```
/// use starling_training::{state::StateView, AdamW, AdamWConfig, ParamSet};
/// let mut params = ParamSet::new();
/// params.add("w", &[2], &[0.5, -0.5])?;
/// let opt = AdamW::new(AdamWConfig::new(1e-3), params.len())?;
/// let snapshot = StateView::new(7, &params).optimizer("opt", &opt).counter("samples", 4096).capture()?;
/// assert_eq!(snapshot.epoch(), 7);
/// assert_eq!(snapshot.buffer("param"), Some(&[0.5, -0.5][..]));
/// assert_eq!(snapshot.counters()["samples"], 4096);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct StateView<'a> {
    pub(crate) epoch: u64,
    pub(crate) params: &'a ParamSet,
    pub(crate) optimizers: Vec<(String, &'a dyn Optimizer)>,
    pub(crate) buffers: Vec<(String, &'a [f32])>,
    pub(crate) counters: BTreeMap<String, u64>,
}

impl<'a> StateView<'a> {
    /// The state at `epoch` of `params` alone.
    ///
    /// ```
    /// let params = starling_training::ParamSet::new();
    /// let _view = starling_training::state::StateView::new(3, &params);
    /// ```
    pub fn new(epoch: u64, params: &'a ParamSet) -> Self {
        StateView {
            epoch,
            params,
            optimizers: Vec::new(),
            buffers: Vec::new(),
            counters: BTreeMap::new(),
        }
    }

    /// Adds an optimizer's state buffers and step count under `name`.
    ///
    /// ```
    /// use starling_training::{state::StateView, ParamSet, Sgd, SgdConfig};
    /// let params = ParamSet::new();
    /// let sgd = Sgd::new(SgdConfig::new(0.1), 0)?;
    /// let _view = StateView::new(0, &params).optimizer("opt", &sgd);
    /// # Ok::<(), starling_training::OptimError>(())
    /// ```
    pub fn optimizer(mut self, name: impl Into<String>, optimizer: &'a dyn Optimizer) -> Self {
        self.optimizers.push((name.into(), optimizer));
        self
    }

    /// Adds an extra buffer of one value per parameter (for example DiLoCo's phase start).
    ///
    /// ```
    /// let params = starling_training::ParamSet::new();
    /// let _view = starling_training::state::StateView::new(0, &params).buffer("anchor", &[]);
    /// ```
    pub fn buffer(mut self, name: impl Into<String>, values: &'a [f32]) -> Self {
        self.buffers.push((name.into(), values));
        self
    }

    /// Adds a counter (a later value for the same name replaces the earlier one).
    ///
    /// ```
    /// let params = starling_training::ParamSet::new();
    /// let _view = starling_training::state::StateView::new(0, &params).counter("samples", 10);
    /// ```
    pub fn counter(mut self, name: impl Into<String>, value: u64) -> Self {
        self.counters.insert(name.into(), value);
        self
    }
}

/// Where a joiner writes a verified [`SyncedState`](crate::sync::SyncedState): its parameters, optimizers and extra
/// buffers, named as on the donors' [`StateView`].
///
/// ```
/// use starling_training::{state::{StateTarget, StateView}, ParamSet, Sgd, SgdConfig};
/// let mut params = ParamSet::new();
/// params.add_zeros("w", &[2])?;
/// let mut sgd = Sgd::new(SgdConfig::new(0.1).momentum(0.9), params.len())?;
/// // Donors and joiner describe the same layout.
/// let donor_layout = StateView::new(0, &params).optimizer("opt", &sgd).layout();
/// assert_eq!(StateTarget::new(&mut params).optimizer("opt", &mut sgd).layout(), donor_layout);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct StateTarget<'a> {
    pub(crate) params: &'a mut ParamSet,
    pub(crate) optimizers: Vec<(String, &'a mut dyn Optimizer)>,
    pub(crate) buffers: Vec<(String, &'a mut [f32])>,
}

impl<'a> StateTarget<'a> {
    /// Writes into `params`.
    ///
    /// ```
    /// let mut params = starling_training::ParamSet::new();
    /// let _target = starling_training::state::StateTarget::new(&mut params);
    /// ```
    pub fn new(params: &'a mut ParamSet) -> Self {
        StateTarget {
            params,
            optimizers: Vec::new(),
            buffers: Vec::new(),
        }
    }

    /// Also writes the optimizer the donors name `name` (state buffers and step count).
    ///
    /// ```
    /// use starling_training::{state::StateTarget, ParamSet, Sgd, SgdConfig};
    /// let mut params = ParamSet::new();
    /// let mut sgd = Sgd::new(SgdConfig::new(0.1), 0)?;
    /// let _target = StateTarget::new(&mut params).optimizer("opt", &mut sgd);
    /// # Ok::<(), starling_training::OptimError>(())
    /// ```
    pub fn optimizer(mut self, name: impl Into<String>, optimizer: &'a mut dyn Optimizer) -> Self {
        self.optimizers.push((name.into(), optimizer));
        self
    }

    /// Also writes the extra buffer the donors name `name`.
    ///
    /// ```
    /// let mut params = starling_training::ParamSet::new();
    /// let mut anchor: Vec<f32> = Vec::new();
    /// let _target = starling_training::state::StateTarget::new(&mut params).buffer("anchor", &mut anchor);
    /// ```
    pub fn buffer(mut self, name: impl Into<String>, values: &'a mut [f32]) -> Self {
        self.buffers.push((name.into(), values));
        self
    }
}
