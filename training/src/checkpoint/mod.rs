//! Checkpoints of the whole training state, so a restarted peer resumes where it stopped.
//!
//! [`StateView::save`] writes one, [`StateTarget::load`] reads one back (the builders of
//! [`crate::state`], shared with state sync). A checkpoint is a directory with two files:
//!
//! - `tensors-<epoch>-<hash>.safetensors`: every parameter (`param/<tensor>`), every optimizer state
//!   buffer (`optim/<optimizer>/<state>/<tensor>`) and every extra buffer (`buffer/<buffer>/<tensor>`),
//!   each with its tensor's shape, as little-endian `f32`. Gradients are not saved.
//! - `checkpoint.json` ([`CheckpointMeta`]): format and version, epoch, counters, the schema (names
//!   and shapes, in order) and its hash, each optimizer's kind, hyper-parameters and step count, and
//!   the tensors file's name, size and content hash.
//!
//! Saving writes the tensors to a new file, syncs it, then replaces `checkpoint.json` by rename: a
//! crash at any point leaves either the old checkpoint or the new one, never a mix. Loading checks
//! everything (metadata, content hash, every tensor's dtype and shape against the caller's
//! [`ParamSet`], optimizer kinds and state names) before it writes anything, and names the tensor
//! and the expected and actual values when something does not match. One writer per directory.
//!
//! ```
//! use starling_training::state::{StateTarget, StateView};
//! use starling_training::{AdamW, AdamWConfig, Optimizer, ParamSet};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let mut params = ParamSet::new();
//! params.add("w", &[2, 2], &[0.1, -0.2, 0.3, -0.4])?;
//! params.grads_mut().copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
//! let mut opt = AdamW::new(AdamWConfig::new(1e-2), params.len())?;
//! opt.step_set(&mut params)?;
//! StateView::new(3, &params).counter("samples", 512).optimizer("opt", &opt).save(dir.path())?;
//!
//! // A restarted peer registers the same tensors and loads.
//! let mut resumed = ParamSet::new();
//! resumed.add_zeros("w", &[2, 2])?;
//! let mut resumed_opt = AdamW::new(AdamWConfig::default(), resumed.len())?;
//! let meta = StateTarget::new(&mut resumed).optimizer("opt", &mut resumed_opt).load(dir.path())?;
//! assert_eq!((meta.epoch, meta.counters["samples"]), (3, 512));
//! assert_eq!(resumed.params(), params.params());
//! assert_eq!(resumed_opt.state(), opt.state());
//! assert_eq!((resumed_opt.steps(), resumed_opt.lr()), (1, 1e-2));
//!
//! // A model with another shape is refused, naming the tensor.
//! let mut other = ParamSet::new();
//! other.add_zeros("w", &[4])?;
//! let err = StateTarget::new(&mut other).load(dir.path()).unwrap_err();
//! assert!(err.to_string().contains("\"w\""));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod files;
mod meta;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::optim::Optimizer;
use crate::params::ParamSet;
use crate::state::{StateTarget, StateView};

pub use files::read_meta;
pub use meta::{CheckpointError, CheckpointMeta, OptimizerMeta, SchemaEntry};

use meta::{
    buffer_key, check_len, check_meta, check_names, expected_keys, hex, optim_key, param_key,
};

/// The `format` field of every `checkpoint.json`.
pub const FORMAT: &str = "starling-training-checkpoint";

/// Version of the layout this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// Name of the metadata file inside a checkpoint directory.
pub const META_FILE: &str = "checkpoint.json";

impl StateView<'_> {
    /// Writes the checkpoint into `dir` (created if missing), replacing the one there atomically,
    /// and returns its metadata.
    ///
    /// ```
    /// use starling_training::{checkpoint::read_meta, state::StateView, ParamSet};
    /// let dir = tempfile::tempdir().unwrap();
    /// let mut params = ParamSet::new();
    /// params.add("w", &[2], &[1.0, 2.0])?;
    /// let saved = StateView::new(1, &params).save(dir.path())?;
    /// assert_eq!(read_meta(dir.path())?, saved);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<CheckpointMeta, CheckpointError> {
        self.validate()?;
        let dir = dir.as_ref();
        let mut tensors = Vec::new();
        for (_, info) in self.params.iter() {
            let range = info.range();
            tensors.push((
                param_key(info.name()),
                info.shape(),
                &self.params.params()[range],
            ));
            for (opt_name, opt) in &self.optimizers {
                for (state, values) in opt.state() {
                    let key = optim_key(opt_name, state, info.name());
                    tensors.push((key, info.shape(), &values[info.range()]));
                }
            }
            for (buffer, values) in &self.buffers {
                tensors.push((
                    buffer_key(buffer, info.name()),
                    info.shape(),
                    &values[info.range()],
                ));
            }
        }
        let written = files::write_tensors(dir, self.epoch, tensors)?;
        let meta = CheckpointMeta {
            format: FORMAT.to_string(),
            version: FORMAT_VERSION,
            epoch: self.epoch,
            counters: self.counters.clone(),
            schema_hash: hex(self.params.schema_hash()),
            schema: self
                .params
                .iter()
                .map(|(_, t)| SchemaEntry {
                    name: t.name().to_string(),
                    shape: t.shape().to_vec(),
                })
                .collect(),
            optimizers: self
                .optimizers
                .iter()
                .map(|(name, opt)| {
                    let meta = OptimizerMeta {
                        config: opt.config(),
                        steps: opt.steps(),
                        state: opt.state().iter().map(|(s, _)| s.to_string()).collect(),
                    };
                    (name.clone(), meta)
                })
                .collect(),
            buffers: self.buffers.iter().map(|(name, _)| name.clone()).collect(),
            tensors_file: written.file_name,
            tensors_bytes: written.bytes,
            tensors_hash: hex(written.hash),
        };
        files::write_meta(dir, &meta)?;
        Ok(meta)
    }

    fn validate(&self) -> Result<(), CheckpointError> {
        let len = self.params.len();
        let names = self.optimizers.iter().map(|(n, _)| n.as_str());
        check_names("optimizer", names)?;
        check_names("buffer", self.buffers.iter().map(|(n, _)| n.as_str()))?;
        for (name, opt) in &self.optimizers {
            check_len(&format!("optimizer {name:?}"), len, opt.len())?;
            let states = opt.state();
            check_names("optimizer state", states.iter().map(|(s, _)| *s))?;
            for (state, values) in states {
                check_len(
                    &format!("state {state:?} of optimizer {name:?}"),
                    len,
                    values.len(),
                )?;
            }
        }
        for (name, values) in &self.buffers {
            check_len(&format!("buffer {name:?}"), len, values.len())?;
        }
        Ok(())
    }
}

impl StateTarget<'_> {
    /// Checks the checkpoint in `dir` against everything asked for, then loads it; on error nothing
    /// has been written. Returns the metadata (epoch, counters, ...).
    ///
    /// Loading overwrites the parameters, zeroes the gradients, and gives each optimizer the saved
    /// hyper-parameters, step count and state (change the learning rate afterwards if you mean to).
    /// Optimizers and buffers in the checkpoint that are not asked for are ignored.
    ///
    /// ```
    /// use starling_training::{state::{StateTarget, StateView}, ParamSet};
    /// let dir = tempfile::tempdir().unwrap();
    /// let mut params = ParamSet::new();
    /// params.add("w", &[2], &[1.0, 2.0])?;
    /// StateView::new(9, &params).save(dir.path())?;
    /// params.params_mut().fill(0.0);
    /// let meta = StateTarget::new(&mut params).load(dir.path())?;
    /// assert_eq!((meta.epoch, params.params()), (9, &[1.0, 2.0][..]));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn load(self, dir: impl AsRef<Path>) -> Result<CheckpointMeta, CheckpointError> {
        let dir = dir.as_ref();
        let meta = read_meta(dir)?;
        check_schema(self.params, &meta)?;
        let len = self.params.len();
        check_names("optimizer", self.optimizers.iter().map(|(n, _)| n.as_str()))?;
        check_names("buffer", self.buffers.iter().map(|(n, _)| n.as_str()))?;
        let mut opt_metas = Vec::new();
        for (name, opt) in &self.optimizers {
            opt_metas.push(check_optimizer(name, &**opt, &meta, len)?);
        }
        for (name, values) in &self.buffers {
            if !meta.buffers.contains(name) {
                return Err(CheckpointError::MissingBuffer {
                    name: name.clone(),
                    available: meta.buffers.clone(),
                });
            }
            check_len(&format!("buffer {name:?}"), len, values.len())?;
        }
        let bytes = files::read_tensors(dir, &meta, len)?;
        let tensors = files::parse_tensors(dir, &meta, &bytes)?;

        // Everything is checked: from here on nothing can fail for this crate's optimizers.
        let layout: Vec<(String, std::ops::Range<usize>)> = self
            .params
            .iter()
            .map(|(_, t)| (t.name().to_string(), t.range()))
            .collect();
        for (tensor, range) in &layout {
            let out = &mut self.params.params_mut()[range.clone()];
            files::copy_tensor(&tensors, &param_key(tensor), out)?;
        }
        self.params.zero_grads();
        for ((name, opt), saved) in self.optimizers.into_iter().zip(opt_metas) {
            restore_optimizer(&name, opt, saved, &tensors, self.params)?;
        }
        for (name, values) in self.buffers {
            for (tensor, range) in &layout {
                let key = buffer_key(&name, tensor);
                files::copy_tensor(&tensors, &key, &mut values[range.clone()])?;
            }
        }
        Ok(meta)
    }
}

/// Checks one optimizer asked for against the checkpoint; returns what was saved for it.
fn check_optimizer(
    name: &str,
    opt: &dyn Optimizer,
    meta: &CheckpointMeta,
    len: usize,
) -> Result<OptimizerMeta, CheckpointError> {
    let saved = meta
        .optimizers
        .get(name)
        .ok_or_else(|| CheckpointError::MissingOptimizer {
            name: name.to_string(),
            available: meta.optimizers.keys().cloned().collect(),
        })?;
    let (model, checkpoint) = (opt.config().kind(), saved.config.kind());
    if model != checkpoint {
        return Err(CheckpointError::OptimizerKind {
            name: name.to_string(),
            model,
            checkpoint,
        });
    }
    check_len(&format!("optimizer {name:?}"), len, opt.len())?;
    let optim_err = |source| CheckpointError::Optim {
        name: name.to_string(),
        source,
    };
    // A fresh optimizer with the saved hyper-parameters tells which state buffers it keeps.
    let fresh = saved.config.build(len).map_err(optim_err)?;
    let expected: Vec<&str> = fresh.state().iter().map(|(s, _)| *s).collect();
    if expected != saved.state {
        return Err(CheckpointError::OptimizerState {
            name: name.to_string(),
            detail: format!(
                "the checkpoint lists state {:?}, but a {checkpoint} optimizer with its hyper-parameters keeps {expected:?}",
                saved.state
            ),
        });
    }
    Ok(saved.clone())
}

/// Gives `opt` the saved configuration, step count and state.
fn restore_optimizer(
    name: &str,
    opt: &mut dyn Optimizer,
    saved: OptimizerMeta,
    tensors: &safetensors::SafeTensors<'_>,
    params: &ParamSet,
) -> Result<(), CheckpointError> {
    opt.set_config(&saved.config)
        .map_err(|source| CheckpointError::Optim {
            name: name.to_string(),
            source,
        })?;
    opt.set_steps(saved.steps);
    let mut states = opt.state_mut();
    let names: Vec<&str> = states.iter().map(|(s, _)| *s).collect();
    if names != saved.state {
        // Only an `Optimizer` whose state names do not follow its configuration gets here.
        return Err(CheckpointError::OptimizerState {
            name: name.to_string(),
            detail: format!(
                "after set_config it keeps state {names:?}, the checkpoint has {:?}; this optimizer was left part-loaded",
                saved.state
            ),
        });
    }
    for (state, values) in states.iter_mut() {
        for (_, info) in params.iter() {
            let key = optim_key(name, state, info.name());
            files::copy_tensor(tensors, &key, &mut values[info.range()])?;
        }
    }
    Ok(())
}

/// Compares the model's tensors with the checkpoint's schema, naming the first difference.
fn check_schema(params: &ParamSet, meta: &CheckpointMeta) -> Result<(), CheckpointError> {
    let saved: BTreeMap<&str, &[usize]> = meta
        .schema
        .iter()
        .map(|e| (e.name.as_str(), &e.shape[..]))
        .collect();
    for (_, info) in params.iter() {
        match saved.get(info.name()) {
            None => {
                return Err(CheckpointError::NotInCheckpoint {
                    tensor: info.name().to_string(),
                })
            }
            Some(&shape) if shape != info.shape() => {
                return Err(CheckpointError::ShapeMismatch {
                    tensor: info.name().to_string(),
                    model: info.shape().to_vec(),
                    checkpoint: shape.to_vec(),
                })
            }
            Some(_) => {}
        }
    }
    let model: BTreeSet<&str> = params.iter().map(|(_, t)| t.name()).collect();
    if let Some(extra) = meta
        .schema
        .iter()
        .find(|e| !model.contains(e.name.as_str()))
    {
        return Err(CheckpointError::NotInModel {
            tensor: extra.name.clone(),
        });
    }
    let pairs = params.iter().zip(&meta.schema).enumerate();
    for (position, ((_, info), entry)) in pairs {
        if info.name() != entry.name {
            return Err(CheckpointError::OrderMismatch {
                position,
                model: info.name().to_string(),
                checkpoint: entry.name.clone(),
            });
        }
    }
    debug_assert_eq!(hex(params.schema_hash()), meta.schema_hash);
    Ok(())
}
