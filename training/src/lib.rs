//! Many peers train one model: a global batch that means the same on every peer, one optimizer
//! step taken together, local SGD / DiLoCo that averages far less often, and catching up for
//! peers that join late. Framework-agnostic like the averager: the caller registers named flat
//! `f32` buffers and moves its model's values in and out.
//!
//! - [`progress`]: each peer publishes its progress (epoch, samples, rate) in an owner-signed
//!   DHT sub-key; every peer estimates when the swarm reaches the target batch, and learns
//!   whether it is behind.

pub mod progress;

pub use progress::{LocalProgress, ProgressConfig, ProgressTracker, SwarmProgress};
