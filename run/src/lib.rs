//! A Starling training run as a library: what `starling train` and `starling demo` do, usable
//! from any Rust program (and from the Python package) without spawning the binary.
//!
//! - [`manifest`]: a run is a [`RunManifest`] (model, data kind,
//!   optimizer, hyper-parameters, mode, codec, tensor schema), signed by its creator
//!   ([`SignedManifest`]) and kept in the DHT under
//!   `starling.run.NAME` by every peer of the run.
//! - [`setup`]: a new run's manifest from [`Hyper`]-parameters, its data and its
//!   model, and the checks a joiner makes on what it built.
//! - [`data`]: the data loaders: the embedded 8x8 digits, MNIST-style IDX directories, UTF-8
//!   text with a character vocabulary.
//! - [`model`]: the built-in models (`mlp`, `charlm`: a character-level transformer, optionally
//!   with a remote mixture-of-experts layer) as candle modules bound to Starling's flat
//!   parameter buffers.
//! - [`session`]: a peer training in a run until its last epoch: state sync, the collaborative
//!   optimizer (or DiLoCo), checkpoints, evaluation, re-publishing the manifest.
//! - [`checkpoint`]: which run a checkpoint directory belongs to.
//! - [`event`]: what a session reports, to a [`Reporter`] of the caller's.
//! - [`attack`]: a peer that lies on purpose, to test a swarm's defences.
//!
//! ```
//! use starling_run::{data, manifest::DataSpec, model::{self, Eval}, setup};
//!
//! // A run's manifest from hyper-parameters (defaults for the rest), its data and its model.
//! let hyper = setup::Hyper { hidden: Some(16), ..Default::default() };
//! let mut manifest = setup::new_manifest("digits", "mlp", &hyper, DataSpec::Digits)?;
//! let digits = data::Dataset::Images(data::digits());
//! let built = model::build(&manifest, &digits, None)?;
//! manifest.schema_hash = model::schema_hex(&built.params);
//! setup::schema_matches(&manifest, &built)?;
//! // An untrained classifier: about one digit in ten right.
//! match built.net.evaluate(&digits)? {
//!     Eval::Accuracy(a) => assert!((0.0..=1.0).contains(&a)),
//!     Eval::ValLoss(_) => unreachable!("mlp is a classifier"),
//! }
//! # Ok::<(), anyhow::Error>(())
//! ```

#![warn(missing_docs)]

pub mod attack;
pub mod batches;
pub mod checkpoint;
pub mod data;
mod eval;
pub mod event;
pub mod manifest;
pub mod model;
pub mod session;
pub mod setup;

pub use event::{Event, Reporter};
pub use manifest::{RunManifest, SignedManifest};
pub use session::{Outcome, Session};
pub use setup::Hyper;
