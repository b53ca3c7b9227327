//! [`LocalError`]: what can go wrong with local collectives, each message saying what to do.

use thiserror::Error;

/// Errors from local (intra-machine) collectives.
#[derive(Debug, Error)]
pub enum LocalError {
    /// The arguments cannot work (no devices, a device index out of range, a buffer of the
    /// wrong length).
    #[error("invalid local collective: {0}")]
    Invalid(String),
    /// The weights of a weighted mean are unusable.
    #[error("invalid weights {weights:?}: one finite weight >= 0 per device, with a positive sum")]
    InvalidWeights {
        /// The weights given.
        weights: Vec<f32>,
    },
    /// This build has no GPU support.
    #[error("this build has no CUDA support: rebuild with `--features cuda` (for the binary: `cargo build --release -p starling-cli --features cuda`), or use the cpu backend")]
    NoCudaSupport,
    /// The NVIDIA driver library could not be loaded.
    #[error("no NVIDIA driver: libcuda.so / libcuda.so.1 could not be loaded (no GPU, or the driver is not installed); use the cpu backend")]
    NoDriver,
    /// The NCCL library could not be loaded.
    #[error("NCCL not found: cudarc loads `libnccl.so` (not `libnccl.so.2`) from the library path. {hint}")]
    NoNccl {
        /// Where a `libnccl.so.2` was found on this machine and the symlink to create, or how to
        /// install NCCL.
        hint: String,
    },
    /// Fewer devices than asked for.
    #[error("{wanted} devices asked for, but {found} found")]
    NotEnoughDevices {
        /// Devices asked for.
        wanted: usize,
        /// Devices present.
        found: usize,
    },
    /// A CUDA driver call failed.
    #[error("CUDA error: {0}")]
    Cuda(String),
    /// An NCCL call failed.
    #[error("NCCL error: {0}")]
    Nccl(String),
    /// A device thread of the CPU backend failed (a bug); the group can no longer be used.
    #[error("a CPU device thread failed: {0}")]
    Worker(String),
}
