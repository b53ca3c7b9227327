//! Multi-peer integration tests for Starling: whole swarms on 127.0.0.1. The tests live in
//! `tests/tests/`; this library holds their shared helpers, which the `starling bench allreduce`
//! benchmark uses too:
//!
//! - [`AveragingSwarm`]: N averagers on a [`LocalCluster`](starling_node::cluster::LocalCluster),
//!   stepped concurrently; [`RoundCheck`] checks every peer's result span by span against the
//!   exact weighted mean of the contributors its report names.
//! - [`exact_weighted_mean`] and [`WeightedMean`]: the reference mean, in f64.
//! - [`normal_tensors`] (and [`normal_vec`]): deterministic data from
//!   [`starling_compression::synthetic`].
//! - [`GossipSwarm`]: N gossip averagers stepped round by round, with the live peers'
//!   weighted mean and consensus distance ([`Consensus`]).
//! - [`bounded`], [`init_tracing`], [`rel_error`]: every test is time-bounded, logs through
//!   `RUST_LOG`, and measures errors the same way.

use std::time::Duration;

mod gossip;
mod swarm;

pub use gossip::{Consensus, GossipSwarm};

pub use swarm::{
    exact_weighted_mean, normal_tensors, AveragingSwarm, RoundCheck, WeightedMean, EXACT,
};

/// Installs a `tracing` subscriber honouring `RUST_LOG` (once per test binary).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// Runs `fut` and fails the test if it takes longer than `limit`: every test is bounded.
pub async fn bounded<F: std::future::Future>(limit: Duration, fut: F) -> F::Output {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("test exceeded its time bound of {limit:?}"),
    }
}

/// `n` deterministic samples of N(0, 1): [`starling_compression::synthetic::normal`], the one
/// generator of the workspace's tests and benchmarks.
pub fn normal_vec(n: usize, seed: u64) -> Vec<f32> {
    starling_compression::synthetic::normal(n, seed)
}

/// `||a - b|| / ||b||` in f64 (`b` is the reference).
pub fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    starling_compression::bench::relative_error(b, a)
}
