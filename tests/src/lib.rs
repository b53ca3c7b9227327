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

/// Deterministic random normal samples (Box-Muller over a seeded generator).
pub fn normal_vec(n: usize, seed: u64) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
            let u2: f64 = rng.gen();
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

/// `||a - b|| / ||b||` in f64 (`b` is the reference).
pub fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    starling_compression::bench::relative_error(b, a)
}
