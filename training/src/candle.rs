//! Moves a candle model's `Var`s and gradients to and from a [`ParamSet`] (feature `candle`).
//!
//! A [`VarBinding`] remembers, for each `Var`, where its values live in the flat buffers. One call
//! copies all parameters in ([`VarBinding::vars_to_params`]) or out ([`VarBinding::params_to_vars`]),
//! one call copies the gradients of a `backward()` ([`VarBinding::grads_to_set`]) or adds them
//! to what earlier micro-batches left ([`VarBinding::accumulate_grads`]). Vars of any float dtype
//! and on any device work; values pass through `f32`.
//!
//! A trainable var that a `backward()` did not reach is an error naming it
//! ([`BindError::MissingGradients`]), not a silent zero: a model whose graph is cut (candle's fused
//! `layer_norm` and `softmax_last_dim` have no backward) would otherwise train only the layers
//! above the cut. Vars that are meant to stay fixed are declared with [`VarBinding::freeze`].
//!
//! Register vars in the same order on every peer: the order fixes the flat layout. A
//! `candle_nn::VarMap` keeps its vars in a `HashMap`, so sort them by name first.
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use rand::{rngs::StdRng, SeedableRng};
//! use starling_training::{Init, Optimizer, ParamSet, Sgd, SgdConfig, VarBinding};
//!
//! let dev = Device::Cpu;
//! let w = Var::zeros((2, 3), DType::F32, &dev)?;
//! let b = Var::zeros(2, DType::F32, &dev)?;
//! let mut set = ParamSet::new();
//! let binding = VarBinding::register(&mut set, [("fc.weight", w.clone()), ("fc.bias", b.clone())])?;
//! // Seeded init into the flat buffer, then into the Vars.
//! binding.initialize(&mut set, &mut StdRng::seed_from_u64(0), |t| {
//!     if t.shape().len() == 1 { Init::Zeros } else { Init::KaimingUniform }
//! })?;
//!
//! let x = Tensor::new(&[[1f32, 2.0, 3.0]], &dev)?;
//! let loss = x.matmul(&w.as_tensor().t()?)?.broadcast_add(&b)?.sqr()?.sum_all()?;
//! let grads = loss.backward()?;
//! binding.grads_to_set(&grads, &mut set)?;
//! let mut opt = Sgd::new(SgdConfig::new(0.01), set.len())?;
//! opt.step_set(&mut set)?;
//! binding.params_to_vars(&set)?;
//! assert_eq!(w.flatten_all()?.to_vec1::<f32>()?, set.tensor("fc.weight").unwrap_or_default());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::ops::Range;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use rand::Rng;

use crate::params::{Init, ParamError, ParamSet, TensorId, TensorInfo};

/// What went wrong while binding or copying `Var`s.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Registering a var in the [`ParamSet`] failed (duplicate name, ...).
    #[error(transparent)]
    Param(#[from] ParamError),
    /// A candle operation on a var failed.
    #[error("var {name:?}: {source}")]
    Candle {
        /// Tensor name.
        name: String,
        /// candle's error.
        source: candle_core::Error,
    },
    /// A var does not hold floating-point values.
    #[error("var {name:?} has dtype {dtype:?}; only float vars can be trained")]
    Dtype {
        /// Tensor name.
        name: String,
        /// Its dtype.
        dtype: DType,
    },
    /// The var's shape is not the shape of the tensor with its name in the set.
    #[error("var {name:?} has shape {var:?} but the set registers {set:?}")]
    Shape {
        /// Tensor name.
        name: String,
        /// The var's shape.
        var: Vec<usize>,
        /// The set's shape.
        set: Vec<usize>,
    },
    /// Trainable vars that a `backward()` did not reach: the loss does not depend on them, or an
    /// op between them and the loss has no backward (candle's fused `layer_norm`,
    /// `softmax_last_dim`). Nothing was written to the set's gradients.
    #[error(
        "no gradient reached {} of the model's trainable tensors ({}): the loss does not depend \
         on them or an op on their path has no backward (candle's fused layer_norm or \
         softmax_last_dim); declare tensors that must stay fixed with VarBinding::freeze",
        names.len(),
        names.join(", ")
    )]
    MissingGradients {
        /// Their names, in binding order.
        names: Vec<String>,
    },
    /// [`VarBinding::freeze`] named a var this binding does not hold.
    #[error("cannot freeze {name:?}: no var of that name is bound")]
    UnknownVar {
        /// The name given.
        name: String,
    },
    /// The set passed in is not the one this binding was made for (or it lacks the tensor).
    #[error("tensor {name:?} is not where this binding expects it in the set; pass the set the binding was made with")]
    Layout {
        /// Tensor name.
        name: String,
    },
}

#[derive(Debug, Clone)]
struct Bound {
    id: TensorId,
    name: String,
    range: Range<usize>,
    var: Var,
    /// Declared fixed: its gradient is always zero, and a missing one is no error.
    frozen: bool,
}

/// `Var`s bound to tensors of a [`ParamSet`].
#[derive(Debug, Clone)]
pub struct VarBinding {
    bound: Vec<Bound>,
}

impl VarBinding {
    /// Registers each var in `set` under its name, with its shape and current values, in the order
    /// given, and binds it.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// use starling_training::{ParamSet, VarBinding};
    /// let v = Var::ones((2, 2), DType::F32, &Device::Cpu)?;
    /// let mut set = ParamSet::new();
    /// let binding = VarBinding::register(&mut set, [("v", v)])?;
    /// assert_eq!((binding.len(), set.params()), (1, &[1.0f32; 4][..]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn register<S: Into<String>>(
        set: &mut ParamSet,
        vars: impl IntoIterator<Item = (S, Var)>,
    ) -> Result<Self, BindError> {
        let mut bound = Vec::new();
        for (name, var) in vars {
            let name = name.into();
            let values = read_f32(&name, var.as_detached_tensor())?;
            let id = set.add(name.clone(), var.dims(), &values)?;
            let range = set.info(id).map(TensorInfo::range).unwrap_or_default();
            bound.push(Bound {
                id,
                name,
                range,
                var,
                frozen: false,
            });
        }
        Ok(Self { bound })
    }

    /// Binds vars to tensors that `set` already registers under the same names and shapes (for
    /// example a set rebuilt from a checkpoint's schema); values are not copied.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// use starling_training::{ParamSet, VarBinding};
    /// let mut set = ParamSet::new();
    /// set.add("v", &[2], &[3.0, 4.0])?;
    /// let v = Var::zeros(2, DType::F32, &Device::Cpu)?;
    /// let binding = VarBinding::bind(&set, [("v", v.clone())])?;
    /// binding.params_to_vars(&set)?;
    /// assert_eq!(v.to_vec1::<f32>()?, [3.0, 4.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn bind<S: Into<String>>(
        set: &ParamSet,
        vars: impl IntoIterator<Item = (S, Var)>,
    ) -> Result<Self, BindError> {
        let mut bound = Vec::new();
        for (name, var) in vars {
            let name = name.into();
            let info = set
                .id(&name)
                .and_then(|id| set.info(id).map(|info| (id, info)));
            let Some((id, info)) = info else {
                return Err(BindError::Layout { name });
            };
            if info.shape() != var.dims() {
                return Err(BindError::Shape {
                    name,
                    var: var.dims().to_vec(),
                    set: info.shape().to_vec(),
                });
            }
            check_float(&name, var.dtype())?;
            let range = info.range();
            bound.push(Bound {
                id,
                name,
                range,
                var,
                frozen: false,
            });
        }
        Ok(Self { bound })
    }

    /// Number of bound vars.
    ///
    /// ```
    /// let binding = starling_training::VarBinding::register(&mut starling_training::ParamSet::new(), Vec::<(String, candle_core::Var)>::new())?;
    /// assert!(binding.is_empty());
    /// # Ok::<(), starling_training::BindError>(())
    /// ```
    pub fn len(&self) -> usize {
        self.bound.len()
    }

    /// Whether no vars are bound.
    ///
    /// ```
    /// let binding = starling_training::VarBinding::register(&mut starling_training::ParamSet::new(), Vec::<(String, candle_core::Var)>::new())?;
    /// assert_eq!(binding.len(), 0);
    /// # Ok::<(), starling_training::BindError>(())
    /// ```
    pub fn is_empty(&self) -> bool {
        self.bound.is_empty()
    }

    /// The bound vars with their names, in binding order.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// let mut set = starling_training::ParamSet::new();
    /// let v = Var::zeros(3, DType::F32, &Device::Cpu)?;
    /// let binding = starling_training::VarBinding::register(&mut set, [("v", v)])?;
    /// assert_eq!(binding.vars().map(|(n, _)| n).collect::<Vec<_>>(), ["v"]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn vars(&self) -> impl ExactSizeIterator<Item = (&str, &Var)> + '_ {
        self.bound.iter().map(|b| (b.name.as_str(), &b.var))
    }

    /// Copies every var's current values into the set's parameters.
    ///
    /// ```
    /// use candle_core::{DType, Device, Tensor, Var};
    /// let mut set = starling_training::ParamSet::new();
    /// let v = Var::zeros(2, DType::F32, &Device::Cpu)?;
    /// let binding = starling_training::VarBinding::register(&mut set, [("v", v.clone())])?;
    /// v.set(&Tensor::new(&[1f32, 2.0], &Device::Cpu)?)?;
    /// binding.vars_to_params(&mut set)?;
    /// assert_eq!(set.params(), &[1.0, 2.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn vars_to_params(&self, set: &mut ParamSet) -> Result<(), BindError> {
        for b in &self.bound {
            self.check_layout(set, b)?;
            let values = read_f32(&b.name, b.var.as_detached_tensor())?;
            set.params_mut()[b.range.clone()].copy_from_slice(&values);
        }
        Ok(())
    }

    /// Copies the set's parameters into the vars (after a step or an averaging round).
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// let mut set = starling_training::ParamSet::new();
    /// let v = Var::zeros(2, DType::F32, &Device::Cpu)?;
    /// let binding = starling_training::VarBinding::register(&mut set, [("v", v.clone())])?;
    /// set.params_mut().copy_from_slice(&[5.0, 6.0]);
    /// binding.params_to_vars(&set)?;
    /// assert_eq!(v.to_vec1::<f32>()?, [5.0, 6.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn params_to_vars(&self, set: &ParamSet) -> Result<(), BindError> {
        for b in &self.bound {
            self.check_layout(set, b)?;
            let values = &set.params()[b.range.clone()];
            let candle = |source| BindError::Candle {
                name: b.name.clone(),
                source,
            };
            let t = Tensor::from_slice(values, b.var.dims(), b.var.device())
                .and_then(|t| t.to_dtype(b.var.dtype()))
                .map_err(candle)?;
            b.var.set(&t).map_err(candle)?;
        }
        Ok(())
    }

    /// Declares vars fixed: their gradients are always zero (an optimizer with weight decay still
    /// decays them), and a `backward()` that does not reach them is no error. Every other bound
    /// var must get a gradient.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// let mut set = starling_training::ParamSet::new();
    /// let (w, table) = (Var::ones(2, DType::F32, &Device::Cpu)?, Var::ones(2, DType::F32, &Device::Cpu)?);
    /// let mut binding = starling_training::VarBinding::register(&mut set, [("w", w.clone()), ("table", table)])?;
    /// let grads = (w.as_tensor() * 3.0)?.sum_all()?.backward()?;
    /// assert!(binding.grads_to_set(&grads, &mut set).is_err()); // "table" got no gradient
    /// binding.freeze(["table"])?;
    /// binding.grads_to_set(&grads, &mut set)?;
    /// assert_eq!(set.grads(), &[3.0, 3.0, 0.0, 0.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn freeze<S: AsRef<str>>(
        &mut self,
        names: impl IntoIterator<Item = S>,
    ) -> Result<(), BindError> {
        for name in names {
            let name = name.as_ref();
            let b = self
                .bound
                .iter_mut()
                .find(|b| b.name == name)
                .ok_or_else(|| BindError::UnknownVar {
                    name: name.to_string(),
                })?;
            b.frozen = true;
        }
        Ok(())
    }

    /// The names of the vars declared fixed with [`VarBinding::freeze`], in binding order.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// let mut set = starling_training::ParamSet::new();
    /// let v = Var::zeros(1, DType::F32, &Device::Cpu)?;
    /// let mut binding = starling_training::VarBinding::register(&mut set, [("v", v)])?;
    /// binding.freeze(["v"])?;
    /// assert_eq!(binding.frozen().collect::<Vec<_>>(), ["v"]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn frozen(&self) -> impl Iterator<Item = &str> + '_ {
        self.bound
            .iter()
            .filter(|b| b.frozen)
            .map(|b| b.name.as_str())
    }

    /// Copies the gradients of a `backward()` into the set's gradients (frozen vars get zeros).
    /// A trainable var that the `backward()` did not reach is an error that names it
    /// ([`BindError::MissingGradients`]), and the set is left as it was.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// let mut set = starling_training::ParamSet::new();
    /// let v = Var::ones(2, DType::F32, &Device::Cpu)?;
    /// let binding = starling_training::VarBinding::register(&mut set, [("v", v.clone())])?;
    /// let grads = (v.as_tensor() * 3.0)?.sum_all()?.backward()?;
    /// binding.grads_to_set(&grads, &mut set)?;
    /// assert_eq!(set.grads(), &[3.0, 3.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn grads_to_set(&self, grads: &GradStore, set: &mut ParamSet) -> Result<(), BindError> {
        self.move_grads(grads, set, false)
    }

    /// Adds the gradients of a `backward()` to the set's gradients (micro-batch accumulation).
    /// Like [`VarBinding::grads_to_set`], a trainable var without a gradient is an error and
    /// nothing is added.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// let mut set = starling_training::ParamSet::new();
    /// let v = Var::ones(1, DType::F32, &Device::Cpu)?;
    /// let binding = starling_training::VarBinding::register(&mut set, [("v", v.clone())])?;
    /// for _ in 0..2 {
    ///     let grads = (v.as_tensor() * 3.0)?.sum_all()?.backward()?;
    ///     binding.accumulate_grads(&grads, &mut set)?;
    /// }
    /// assert_eq!(set.grads(), &[6.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn accumulate_grads(&self, grads: &GradStore, set: &mut ParamSet) -> Result<(), BindError> {
        self.move_grads(grads, set, true)
    }

    /// Re-initialises every tensor of `set` with the [`Init`] that `rule` picks (see
    /// [`ParamSet::initialize`]), then copies the bound ones into their vars.
    ///
    /// ```
    /// use candle_core::{DType, Device, Var};
    /// use rand::{rngs::StdRng, SeedableRng};
    /// use starling_training::{Init, ParamSet, VarBinding};
    /// let v = Var::zeros(3, DType::F32, &Device::Cpu)?;
    /// let mut set = ParamSet::new();
    /// let binding = VarBinding::register(&mut set, [("v", v.clone())])?;
    /// binding.initialize(&mut set, &mut StdRng::seed_from_u64(1), |_| Init::Constant(0.5))?;
    /// assert_eq!(v.to_vec1::<f32>()?, [0.5; 3]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn initialize<R: Rng + ?Sized>(
        &self,
        set: &mut ParamSet,
        rng: &mut R,
        rule: impl FnMut(&TensorInfo) -> Init,
    ) -> Result<(), BindError> {
        set.initialize(rng, rule)?;
        self.params_to_vars(set)
    }

    fn move_grads(
        &self,
        grads: &GradStore,
        set: &mut ParamSet,
        add: bool,
    ) -> Result<(), BindError> {
        let missing: Vec<String> = self
            .bound
            .iter()
            .filter(|b| !b.frozen && grads.get(b.var.as_tensor()).is_none())
            .map(|b| b.name.clone())
            .collect();
        if !missing.is_empty() {
            return Err(BindError::MissingGradients { names: missing });
        }
        // Read every gradient before writing any, so that an error leaves the set as it was.
        let mut values = Vec::with_capacity(self.bound.len());
        for b in &self.bound {
            self.check_layout(set, b)?;
            let g = match grads.get(b.var.as_tensor()) {
                Some(g) if !b.frozen => g,
                _ => {
                    values.push(None);
                    continue;
                }
            };
            let v = read_f32(&b.name, g.detach())?;
            if v.len() != b.range.len() {
                return Err(BindError::Shape {
                    name: b.name.clone(),
                    var: g.dims().to_vec(),
                    set: b.var.dims().to_vec(),
                });
            }
            values.push(Some(v));
        }
        for (b, v) in self.bound.iter().zip(values) {
            let out = &mut set.grads_mut()[b.range.clone()];
            match (v, add) {
                (Some(v), true) => out.iter_mut().zip(&v).for_each(|(o, v)| *o += v),
                (Some(v), false) => out.copy_from_slice(&v),
                // Frozen: nothing added, or zeros.
                (None, true) => {}
                (None, false) => out.fill(0.0),
            }
        }
        Ok(())
    }

    fn check_layout(&self, set: &ParamSet, b: &Bound) -> Result<(), BindError> {
        match set.info(b.id) {
            Some(info) if info.name() == b.name && info.range() == b.range => Ok(()),
            _ => Err(BindError::Layout {
                name: b.name.clone(),
            }),
        }
    }
}

fn check_float(name: &str, dtype: DType) -> Result<(), BindError> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(BindError::Dtype {
            name: name.to_string(),
            dtype,
        })
    }
}

/// A float tensor's values, row-major, as `f32`.
fn read_f32(name: &str, t: Tensor) -> Result<Vec<f32>, BindError> {
    check_float(name, t.dtype())?;
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|source| BindError::Candle {
            name: name.to_string(),
            source,
        })
}
