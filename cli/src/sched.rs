//! The scheduling policy of a training process (`starling train --sched`).
//!
//! A training peer is CPU-bound batch work with a busy network beside it: every averaging
//! round, progress report and DHT request opens libp2p substreams, and each one wakes the
//! runtime's threads (and libp2p's timer thread) several times. Under Linux's default policy a
//! thread that wakes preempts the one computing, so on a peer with as many busy threads as
//! cores a batch is cut several times by the network's short wake-ups (measured on two
//! pinned peers of the digits MLP: about two involuntary context switches per 0.2 ms batch).
//! Under `SCHED_BATCH` the kernel treats the process as batch work: a thread that wakes does
//! not preempt a running one (it runs when that one blocks, here between batches, or at the
//! scheduler's tick), and the peer does not preempt the user's interactive programs either.
//! Every thread the process starts afterwards inherits the policy, so it is set before the
//! async runtime starts.

use clap::ValueEnum;

/// How the kernel schedules a training process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum CpuPolicy {
    /// `SCHED_BATCH` (Linux): wake-ups do not preempt a running batch, and the peer yields to
    /// interactive programs; the same share of the CPU otherwise.
    #[default]
    Batch,
    /// The system's default policy, unchanged.
    Normal,
}

impl CpuPolicy {
    /// Applies the policy to the calling thread; threads it starts afterwards inherit it.
    /// Call it before any other thread starts. A policy the system does not have (or refuses)
    /// is reported and otherwise ignored: it changes speed, never results.
    ///
    /// ```ignore
    /// CpuPolicy::Batch.apply_to_this_thread();
    /// let runtime = tokio::runtime::Runtime::new()?; // its threads are batch work too
    /// ```
    pub fn apply_to_this_thread(self) {
        match self {
            CpuPolicy::Normal => {}
            CpuPolicy::Batch => match set_batch() {
                Ok(()) => tracing::debug!("scheduling policy: SCHED_BATCH"),
                Err(e) => tracing::warn!("cannot use the batch scheduling policy: {e}"),
            },
        }
    }
}

#[cfg(target_os = "linux")]
fn set_batch() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid `sched_param` for the duration of the call; pid 0 is the
    // calling thread. The call changes nothing but that thread's scheduling policy.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn set_batch() -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "SCHED_BATCH is a Linux scheduling policy",
    ))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn policy() -> i32 {
        // SAFETY: no arguments but the calling thread's pid (0).
        unsafe { libc::sched_getscheduler(0) }
    }

    #[test]
    fn batch_applies_to_the_thread_and_what_it_starts() {
        // In a thread of its own, so the test harness's threads keep their policy.
        std::thread::spawn(|| {
            CpuPolicy::Batch.apply_to_this_thread();
            assert_eq!(policy(), libc::SCHED_BATCH);
            let child = std::thread::spawn(policy).join().unwrap();
            assert_eq!(
                child,
                libc::SCHED_BATCH,
                "a thread started afterwards inherits it"
            );
            let worker = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .build()
                .unwrap()
                .block_on(async { tokio::spawn(async { policy() }).await.unwrap() });
            assert_eq!(
                worker,
                libc::SCHED_BATCH,
                "so do the async runtime's workers"
            );
        })
        .join()
        .unwrap();
    }

    #[test]
    fn normal_changes_nothing() {
        std::thread::spawn(|| {
            let before = policy();
            CpuPolicy::Normal.apply_to_this_thread();
            assert_eq!(policy(), before);
        })
        .join()
        .unwrap();
    }
}
