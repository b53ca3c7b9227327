//! What an expert takes and returns.

use serde::{Deserialize, Serialize};

use crate::{ExpertError, Result};

/// Element types an expert accepts. Payloads travel compressed by the caller's codec and are
/// always `f32` in memory on both ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DType {
    /// 32-bit float.
    F32,
}

/// One tensor of a schema: its per-sample shape (the batch dimension is not included) and type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Shape of one sample, e.g. `[256]` for a vector or `[16, 64]` for a sequence.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
}

impl TensorSpec {
    /// An f32 tensor of the given per-sample shape.
    pub fn f32(shape: &[usize]) -> TensorSpec {
        TensorSpec {
            shape: shape.to_vec(),
            dtype: DType::F32,
        }
    }

    /// Elements per sample.
    pub fn sample_len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Checks that `shape` is `[batch, ..self.shape]` with `batch >= 1` and returns `batch`.
    pub fn check_batch(&self, what: &str, shape: &[usize], dtype: DType) -> Result<usize> {
        if dtype != self.dtype {
            return Err(ExpertError::Invalid(format!(
                "{what}: dtype {dtype:?}, expected {:?}",
                self.dtype
            )));
        }
        match shape.split_first() {
            Some((&b, rest)) if b >= 1 && rest == self.shape.as_slice() => Ok(b),
            _ => Err(ExpertError::Invalid(format!(
                "{what}: shape {shape:?}, expected [batch >= 1, {}]",
                self.shape
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }
}

/// Inputs and outputs of an expert (one tensor each for the built-in experts).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertSchema {
    /// The input tensor.
    pub input: TensorSpec,
    /// The output tensor (also the shape of the output gradient in backward).
    pub output: TensorSpec,
}
