//! The process's one tokio runtime, started on first use, and waiting on it without the GIL.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;

/// Worker threads of the runtime: the network work of every node and averager in the process.
/// Training compute runs on the caller's (Python) threads, never here.
const WORKER_THREADS: usize = 2;

/// The runtime, built on first use.
pub(crate) fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .thread_name("starling")
        .enable_all()
        .build()
        .map_err(|e| {
            crate::errors::StarlingError::new_err(format!("cannot start the runtime: {e}"))
        })?;
    Ok(RUNTIME.get_or_init(|| rt))
}

/// How often a wait looks at Python's pending signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// Runs `fut` to completion on the runtime with the GIL released. Every [`SIGNAL_POLL`] it
/// takes the GIL back for a moment to run Python's signal handlers: Ctrl-C (or any handler
/// that raises) drops `fut`, which cancels what it was doing (a round in flight ends for this
/// peer; the others see it fail), and the exception (`KeyboardInterrupt`) is raised at once.
pub(crate) fn wait<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    py.detach(|| {
        rt.block_on(async {
            let mut fut = std::pin::pin!(fut);
            let mut poll = tokio::time::interval(SIGNAL_POLL);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    out = &mut fut => return Ok(out),
                    _ = poll.tick() => Python::attach(|py| py.check_signals())?,
                }
            }
        })
    })
}

/// Sends Starling's logs (the `tracing` events) to stderr at `level` ("error", "warn",
/// "info", "debug", "trace", or a `RUST_LOG`-style filter such as "starling_averager=debug").
/// Only the first call in a process takes effect.
#[pyfunction]
#[pyo3(signature = (level = "info"))]
pub(crate) fn log_to_stderr(level: &str) -> PyResult<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(level).map_err(|e| {
        pyo3::exceptions::PyValueError::new_err(format!("log level {level:?}: {e}"))
    })?;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    Ok(())
}
