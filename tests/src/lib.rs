//! Multi-peer integration tests for Starling: whole swarms on 127.0.0.1. The tests live in
//! `tests/tests/`; this library holds their shared helpers.

use std::time::Duration;

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
