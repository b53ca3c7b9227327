//! Many peers train one model: a global batch that means the same on every peer, one optimizer
//! step taken together, local SGD / DiLoCo that averages far less often, and catching up for
//! peers that join late. Framework-agnostic like the averager: the caller registers named flat
//! `f32` buffers and moves its model's values in and out.
//!
//! - [`ParamSet`] ([`params`]): named tensors stored as one flat parameter buffer and one flat
//!   gradient buffer (what the averager averages), a stable [`ParamSet::schema_hash`] of the layout,
//!   and seeded initialisation ([`Init`]).
//! - [`Optimizer`] ([`optim`]): [`Sgd`] (momentum, Nesterov) and [`AdamW`] as PyTorch defines them,
//!   written so that the same inputs give the same bits on every peer; [`LrSchedule`] for warmup and
//!   cosine decay.
//! - [`state`]: a peer's training state, borrowed ([`StateView`] to save or serve, [`StateTarget`]
//!   to load or write): the one builder pair checkpoints and state sync share.
//! - [`checkpoint`]: save and load parameters, optimizer state, extra buffers and counters
//!   (safetensors plus `checkpoint.json`), atomically, with every mismatch named.
//! - `candle` (feature `candle`): moves a candle model's `Var`s and gradients to and from a
//!   [`ParamSet`].
//!
//! - [`progress`]: each peer publishes its progress (epoch, samples, rate) in an owner-signed
//!   DHT sub-key; every peer estimates when the swarm reaches the target batch, and learns
//!   whether it is behind.
//! - [`CollaborativeOptimizer`] ([`collaborative`]): gradient mode (average the global batch's
//!   gradients, one shared step; bit-identical peers with the exact codec) and local SGD /
//!   DiLoCo (average parameter deltas every H local steps, outer Nesterov step).
//! - [`sync`]: state sync. Donors ([`sync::StateServer`]) serve a consistent snapshot; a joiner
//!   ([`sync::sync_state`]) takes the manifest of per-chunk hashes the donors agree on, fetches
//!   chunks from several donors in parallel, verifies each, and applies nothing until all did.
//!
//! ```
//! use rand::{rngs::StdRng, SeedableRng};
//! use starling_training::{AdamW, AdamWConfig, Init, Optimizer, ParamSet};
//!
//! let mut params = ParamSet::new();
//! let mut rng = StdRng::seed_from_u64(42);
//! params.add_init("fc.weight", &[4, 3], Init::KaimingUniform, &mut rng)?;
//! params.add_zeros("fc.bias", &[4])?;
//! let mut opt = AdamW::new(AdamWConfig::new(1e-3), params.len())?;
//! // ... the model writes its gradients into params.grads_mut(), the averager averages them ...
//! params.grads_mut().iter_mut().enumerate().for_each(|(i, g)| *g = i as f32 * 0.1 - 0.5);
//! let before = params.params().to_vec();
//! opt.step_set(&mut params)?;
//! assert!(params.params().iter().zip(&before).all(|(a, b)| a != b));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]

#[cfg(feature = "candle")]
pub mod candle;
pub mod checkpoint;
pub mod collaborative;
mod metrics;
pub mod optim;
pub mod params;
pub mod progress;
pub mod state;
pub mod sync;

#[cfg(feature = "candle")]
pub use candle::{BindError, VarBinding};
pub use checkpoint::{CheckpointError, CheckpointMeta};
pub use collaborative::{
    Averaging, CollaborativeConfig, CollaborativeOptimizer, GradientCompression, Mode, StepReport,
    StepTimings, TrainingError,
};
pub use metrics::{LossPoint, TrainingBoard, MAX_BOARD_RUN_LEN};
pub use optim::{
    AdamW, AdamWConfig, LrSchedule, OptimError, Optimizer, OptimizerConfig, Sgd, SgdConfig,
};
pub use params::{schema_hash, Init, ParamError, ParamSet, TensorId, TensorInfo};
pub use progress::{LocalProgress, ProgressConfig, ProgressTracker, SwarmProgress};
pub use state::{StateTarget, StateView};
pub use sync::{
    sync_state, StateServer, StateServerConfig, SyncConfig, SyncError, SyncReport, SyncedState,
};
