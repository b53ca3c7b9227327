//! Starling's decentralized mixture-of-experts.
//!
//! Peers with spare compute host experts; a model anywhere in the swarm routes each input to its
//! best live experts, so the model grows past one machine and no expert is a single point of
//! failure (the idea of hivemind's `RemoteMixtureOfExperts`).
//!
//! - [`Expert`] ([`backend`]): a feed-forward or transformer-block layer on candle, with forward,
//!   and a backward that returns input gradients and takes an AdamW step on its own parameters;
//!   checkpoints as safetensors.
//! - [`ExpertServer`] ([`server`]): hosts many experts; a task pool per expert batches requests
//!   from many clients (max batch, max wait) for one compute thread; bounded queues answer
//!   `Overloaded` instead of growing; declares its experts in the DHT under their grid uid
//!   prefixes ([`grid`]) and renews them; checkpoints and restores.
//! - [`ExpertClient`] / [`RemoteExpert`] ([`client`]): calls over a libp2p stream protocol
//!   ([`wire`], in the node's shared framing; streams opened and confirmed with
//!   `starling_node::streams`), payloads through `starling_compression`, pooled streams,
//!   timeouts.
//! - [`RemoteMixtureOfExperts`] ([`moe`]): gating, beam search over live DHT prefixes, parallel
//!   calls with `k_min` / `timeout_after_k_min`, failed experts masked out of the softmax, and
//!   a candle autograd node so gradients reach the experts and the gate.
//!
//! Shapes are checked on every request on both sides; all payloads are `f32` in memory. A
//! server refuses a call with a [`RemoteError`] (a [`RemoteErrorKind`] and its reason); the
//! client reports it as [`ExpertError::Remote`], naming the expert and the server. A server
//! logs inside a span `experts_server{peer}`.
//!
//! ```
//! use starling_experts::{expand_uid_pattern, Expert, ExpertSpec};
//! // The experts a server would host: a grid row of four feed-forward experts.
//! let spec = ExpertSpec::ffn(16, 64);
//! let uids = expand_uid_pattern("ffn.0.[0:4]")?;
//! let experts = uids
//!     .iter()
//!     .enumerate()
//!     .map(|(i, uid)| Ok((uid.clone(), Expert::new(&spec, i as u64)?)))
//!     .collect::<starling_experts::Result<Vec<_>>>()?;
//! assert_eq!(experts[3].0, "ffn.0.3");
//! assert_eq!(experts[3].1.schema().input.shape, vec![16]);
//! # Ok::<(), starling_experts::ExpertError>(())
//! ```

#![warn(missing_docs)]

pub mod activations;
pub mod backend;
pub mod board;
pub mod client;
mod error;
mod ffn_step;
pub mod grid;
pub mod moe;
mod schema;
pub mod server;
pub mod wire;

pub use activations::ActivationReuse;
pub use backend::{AdamWSpec, Expert, ExpertKind, ExpertSpec};
pub use board::ExpertsBoard;
pub use client::{ClientConfig, ExpertClient, RemoteExpert};
pub use error::{ExpertError, RemoteError, RemoteErrorKind, Result};
pub use ffn_step::BackwardPhases;
pub use grid::{expand_uid_pattern, ExpertHost, ExpertUid};
pub use moe::{MoeConfig, MoeStats, RemoteMixtureOfExperts};
pub use schema::{DType, ExpertSchema, TensorSpec};
pub use server::{ExpertServer, ServerConfig, ServerStats};
pub use wire::{ExpertInfo, EXPERTS_PROTOCOL};

pub use candle_core;
pub use candle_nn;
