//! Multi-peer integration tests for Starling: whole swarms on 127.0.0.1. The tests live in
//! `tests/tests/`; this library gives them the in-process swarms of
//! [`starling_bench::harness`] (the ones `starling bench` measures with) and what only tests
//! need:
//!
//! - [`AveragingSwarm`], [`RoundCheck`], [`exact_weighted_mean`], [`WeightedMean`],
//!   [`normal_tensors`], [`normal_vec`], [`GossipSwarm`], [`Consensus`], [`rel_error`]: see
//!   [`starling_bench::harness`].
//! - [`bounded`], [`init_tracing`]: every test is time-bounded and logs through `RUST_LOG`.

#![warn(missing_docs)]

use std::time::Duration;

pub use starling_bench::harness::{
    exact_weighted_mean, normal_tensors, normal_vec, rel_error, AveragingSwarm, Consensus,
    GossipSwarm, RoundCheck, WeightedMean, EXACT,
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
