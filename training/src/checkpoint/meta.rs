//! What `checkpoint.json` holds, the errors of this module, and the checks on metadata alone.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{FORMAT, FORMAT_VERSION};
use crate::optim::{OptimError, OptimizerConfig};
use crate::params::schema_hash;

/// What went wrong while saving or loading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The directory does not hold a checkpoint this version can read.
    #[error("{}: {detail}", path.display())]
    Format {
        /// The metadata file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// A file's content does not match what the metadata recorded (damaged or replaced).
    #[error("{} is corrupt: {detail}; restore it from another copy or a peer", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Expected and actual size or hash.
        detail: String,
    },
    /// The tensors file is not valid safetensors.
    #[error("{}: not a valid safetensors file: {source}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        source: safetensors::SafeTensorError,
    },
    /// A tensor in the tensors file is missing, unexpected, or has the wrong dtype or shape.
    #[error("tensor {key:?} in the tensors file: {detail}")]
    BadTensor {
        /// Its key (`param/<tensor>`, `optim/<optimizer>/<state>/<tensor>`, `buffer/<buffer>/<tensor>`).
        key: String,
        /// Expected and actual.
        detail: String,
    },
    /// The model registers a tensor the checkpoint lacks.
    #[error("tensor {tensor:?} of the model is not in the checkpoint")]
    NotInCheckpoint {
        /// Tensor name.
        tensor: String,
    },
    /// The checkpoint holds a tensor the model does not register.
    #[error("tensor {tensor:?} of the checkpoint is not in the model")]
    NotInModel {
        /// Tensor name.
        tensor: String,
    },
    /// A tensor has another shape in the checkpoint than in the model.
    #[error(
        "tensor {tensor:?} has shape {model:?} in the model but {checkpoint:?} in the checkpoint"
    )]
    ShapeMismatch {
        /// Tensor name.
        tensor: String,
        /// Shape registered in the model.
        model: Vec<usize>,
        /// Shape in the checkpoint.
        checkpoint: Vec<usize>,
    },
    /// Same tensors, another registration order: the flat layouts differ.
    #[error("tensor #{position} is {model:?} in the model but {checkpoint:?} in the checkpoint; register tensors in the checkpoint's order")]
    OrderMismatch {
        /// Index in registration order.
        position: usize,
        /// The model's tensor there.
        model: String,
        /// The checkpoint's tensor there.
        checkpoint: String,
    },
    /// An optimizer asked for is not in the checkpoint.
    #[error("optimizer {name:?} is not in the checkpoint (it has {available:?})")]
    MissingOptimizer {
        /// Name asked for.
        name: String,
        /// Names the checkpoint has.
        available: Vec<String>,
    },
    /// The optimizer asked for is of another kind than the one saved.
    #[error("optimizer {name:?} is {model} here but {checkpoint} in the checkpoint")]
    OptimizerKind {
        /// Optimizer name.
        name: String,
        /// Kind given to `load`.
        model: &'static str,
        /// Kind saved.
        checkpoint: &'static str,
    },
    /// An optimizer's saved state buffers do not match its kind and hyper-parameters.
    #[error("optimizer {name:?}: {detail}")]
    OptimizerState {
        /// Optimizer name.
        name: String,
        /// Expected and actual state names.
        detail: String,
    },
    /// An optimizer's hyper-parameters were refused.
    #[error("optimizer {name:?}: {source}")]
    Optim {
        /// Optimizer name.
        name: String,
        /// Why.
        source: OptimError,
    },
    /// An extra buffer asked for is not in the checkpoint.
    #[error("buffer {name:?} is not in the checkpoint (it has {available:?})")]
    MissingBuffer {
        /// Name asked for.
        name: String,
        /// Names the checkpoint has.
        available: Vec<String>,
    },
    /// An optimizer or buffer does not have one value per parameter.
    #[error("{what} has {actual} values but the parameters have {expected}")]
    Length {
        /// Which optimizer, state or buffer.
        what: String,
        /// Number of parameters.
        expected: usize,
        /// Its length.
        actual: usize,
    },
    /// An optimizer, buffer or counter name is empty, repeated or contains `/`.
    #[error("invalid name {name:?}: {reason}")]
    InvalidName {
        /// The name.
        name: String,
        /// Why.
        reason: String,
    },
}

/// The contents of `checkpoint.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`FORMAT_VERSION`] of the writer.
    pub version: u32,
    /// The caller's epoch (for example the collaborative step) at the time of saving.
    pub epoch: u64,
    /// Other counters the caller chose to keep (samples seen, local steps, ...).
    pub counters: BTreeMap<String, u64>,
    /// [`crate::ParamSet::schema_hash`] as 16 hex digits.
    pub schema_hash: String,
    /// Every tensor's name and shape, in registration order.
    pub schema: Vec<SchemaEntry>,
    /// Each optimizer's kind, hyper-parameters, step count and state names.
    pub optimizers: BTreeMap<String, OptimizerMeta>,
    /// Names of the extra buffers.
    pub buffers: Vec<String>,
    /// File name of the tensors, inside the checkpoint directory.
    pub tensors_file: String,
    /// Its size in bytes.
    pub tensors_bytes: u64,
    /// Its content hash (FNV-1a over little-endian 64-bit words, then the length), 16 hex digits.
    pub tensors_hash: String,
}

/// One tensor of a checkpoint's schema.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchemaEntry {
    /// Tensor name.
    pub name: String,
    /// Tensor shape.
    pub shape: Vec<usize>,
}

/// What a checkpoint records of one optimizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerMeta {
    /// Kind and hyper-parameters (learning rate included).
    pub config: OptimizerConfig,
    /// Steps taken.
    pub steps: u64,
    /// Names of its state buffers, in [`crate::Optimizer::state`] order.
    pub state: Vec<String>,
}

pub(super) fn check_names<'n>(
    what: &str,
    names: impl IntoIterator<Item = &'n str>,
) -> Result<(), CheckpointError> {
    let mut seen = BTreeSet::new();
    for name in names {
        let reason = if name.is_empty() {
            Some(format!("{what} names must not be empty"))
        } else if name.contains('/') {
            Some(format!("{what} names must not contain '/'"))
        } else if !seen.insert(name) {
            Some(format!("two {what}s share this name"))
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(CheckpointError::InvalidName {
                name: name.to_string(),
                reason,
            });
        }
    }
    Ok(())
}

pub(super) fn check_len(what: &str, expected: usize, actual: usize) -> Result<(), CheckpointError> {
    if expected != actual {
        return Err(CheckpointError::Length {
            what: what.to_string(),
            expected,
            actual,
        });
    }
    Ok(())
}

pub(super) fn hex(v: u64) -> String {
    format!("{v:016x}")
}

pub(super) fn param_key(tensor: &str) -> String {
    format!("param/{tensor}")
}

pub(super) fn optim_key(optimizer: &str, state: &str, tensor: &str) -> String {
    format!("optim/{optimizer}/{state}/{tensor}")
}

pub(super) fn buffer_key(buffer: &str, tensor: &str) -> String {
    format!("buffer/{buffer}/{tensor}")
}

/// Every key the tensors file of `meta` must hold, with its shape.
pub(super) fn expected_keys(meta: &CheckpointMeta) -> BTreeMap<String, &[usize]> {
    let mut keys = BTreeMap::new();
    for entry in &meta.schema {
        let shape = &entry.shape[..];
        keys.insert(param_key(&entry.name), shape);
        for (opt, saved) in &meta.optimizers {
            for state in &saved.state {
                keys.insert(optim_key(opt, state, &entry.name), shape);
            }
        }
        for buffer in &meta.buffers {
            keys.insert(buffer_key(buffer, &entry.name), shape);
        }
    }
    keys
}

/// Checks that `meta`'s own fields agree with each other (schema hash, names).
pub(super) fn check_meta(meta: &CheckpointMeta) -> Result<(), String> {
    if meta.format != FORMAT {
        return Err(format!("format is {:?}, expected {FORMAT:?}", meta.format));
    }
    if meta.version != FORMAT_VERSION {
        return Err(format!(
            "format version {} is not supported (this build reads version {FORMAT_VERSION})",
            meta.version
        ));
    }
    let hash = hex(schema_hash(
        meta.schema.iter().map(|e| (e.name.as_str(), &e.shape[..])),
    ));
    if hash != meta.schema_hash {
        return Err(format!(
            "schema hash {} does not match its schema (hashes to {hash})",
            meta.schema_hash
        ));
    }
    check_names("optimizer", meta.optimizers.keys().map(String::as_str))
        .map_err(|e| e.to_string())?;
    check_names("buffer", meta.buffers.iter().map(String::as_str)).map_err(|e| e.to_string())?;
    for saved in meta.optimizers.values() {
        check_names("optimizer state", saved.state.iter().map(String::as_str))
            .map_err(|e| e.to_string())?;
    }
    let mut seen = BTreeSet::new();
    if let Some(dup) = meta.schema.iter().find(|e| !seen.insert(e.name.as_str())) {
        return Err(format!("tensor {:?} appears twice in the schema", dup.name));
    }
    Ok(())
}
