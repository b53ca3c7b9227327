//! The compute thread: owns every expert and runs batches, info requests and checkpoints in
//! arrival order, off the tokio workers that drive the network.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use candle_core::Tensor;
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use super::batcher::{Kind, Task};
use super::{ServerStats, Shared};
use crate::backend::Expert;
use crate::error::{RemoteError, RemoteErrorKind};
use crate::wire::ExpertInfo;
use crate::{ExpertError, Result};

/// Work for the runtime thread, done in arrival order.
pub(super) enum Job {
    /// One batch for one expert; each task gets its rows of the result.
    Run {
        uid: Arc<str>,
        kind: Kind,
        tasks: Vec<Task>,
    },
    /// Describe an expert.
    Info(String, oneshot::Sender<Option<ExpertInfo>>),
    /// Checkpoint every expert into a directory.
    Save(PathBuf, oneshot::Sender<Result<()>>),
    /// End the thread (after the jobs queued before it).
    Stop,
}

/// Where expert `uid` is checkpointed under `dir`.
pub(super) fn checkpoint_path(dir: &std::path::Path, uid: &str) -> PathBuf {
    dir.join(format!("{uid}.safetensors"))
}

/// Asks the runtime to describe expert `uid`; `None` when it is not hosted or the runtime
/// has stopped.
pub(super) async fn expert_info(shared: &Shared, uid: &str) -> Option<ExpertInfo> {
    let (tx, rx) = oneshot::channel();
    shared
        .runtime
        .send(Job::Info(uid.to_string(), tx))
        .await
        .ok()?;
    rx.await.ok().flatten()
}

/// Has the runtime checkpoint every expert into `dir` (between batches, so each file is a
/// consistent state); the last failure, if any.
pub(super) async fn save_all(shared: &Shared, dir: PathBuf) -> Result<()> {
    let (tx, rx) = oneshot::channel();
    shared
        .runtime
        .send(Job::Save(dir, tx))
        .await
        .map_err(|_| ExpertError::Closed)?;
    rx.await.map_err(|_| ExpertError::Closed)?
}

/// The compute thread: owns every expert, runs batches in arrival order.
pub(super) fn run_runtime(
    mut experts: HashMap<String, Expert>,
    mut jobs: mpsc::Receiver<Job>,
    stats: Arc<ServerStats>,
    max_request_rows: usize,
) {
    while let Some(job) = jobs.blocking_recv() {
        match job {
            Job::Run { uid, kind, tasks } => {
                let Some(expert) = experts.get_mut(&*uid) else {
                    continue;
                };
                let rows: usize = tasks.iter().map(|t| t.rows).sum();
                let started = std::time::Instant::now();
                let result = run_batch(expert, kind, &tasks);
                stats.record_phases(
                    matches!(kind, Kind::Forward),
                    rows,
                    started.elapsed(),
                    expert.last_backward_phases(),
                );
                stats.batches.fetch_add(1, Ordering::Relaxed);
                stats.rows.fetch_add(rows as u64, Ordering::Relaxed);
                match result {
                    Ok(out) => {
                        let mut offset = 0;
                        for t in tasks {
                            let part = out.narrow(0, offset, t.rows).map_err(|e| {
                                RemoteError::new(RemoteErrorKind::Internal, e.to_string())
                            });
                            offset += t.rows;
                            let _ = t.reply.send(part);
                        }
                    }
                    Err(e) => {
                        warn!(%uid, ?kind, "batch failed: {e}");
                        for t in tasks {
                            let _ = t.reply.send(Err(RemoteError::new(
                                RemoteErrorKind::Internal,
                                e.to_string(),
                            )));
                        }
                    }
                }
            }
            Job::Info(uid, reply) => {
                let info = experts.get(&uid).map(|e| ExpertInfo {
                    uid: uid.clone(),
                    spec: e.spec().clone(),
                    schema: e.schema().clone(),
                    steps: e.steps(),
                    max_request_rows,
                });
                let _ = reply.send(info);
            }
            Job::Stop => break,
            Job::Save(dir, reply) => {
                let mut result = Ok(());
                for (uid, e) in &experts {
                    if let Err(err) = e.save(&checkpoint_path(&dir, uid)) {
                        warn!(%uid, "checkpoint failed: {err}");
                        result = Err(err);
                    }
                }
                let _ = reply.send(result);
            }
        }
    }
}

/// Runs one batch: the tasks' inputs (and, for a backward, output gradients) concatenated
/// along the batch dimension; the result has one row per input row, in task order.
pub(super) fn run_batch(expert: &mut Expert, kind: Kind, tasks: &[Task]) -> Result<Tensor> {
    let cat = |ts: Vec<&Tensor>| -> Result<Tensor> {
        if ts.len() == 1 {
            Ok(ts[0].clone())
        } else {
            Ok(Tensor::cat(&ts, 0)?)
        }
    };
    let x = cat(tasks.iter().map(|t| &t.inputs).collect())?;
    let parts: Vec<usize> = tasks.iter().map(|t| t.rows).collect();
    match kind {
        Kind::Forward => expert.forward_parts(&x, &parts),
        Kind::Backward => {
            let g = cat(tasks.iter().filter_map(|t| t.grads.as_ref()).collect())?;
            expert.backward_parts(&x, &g, &parts)
        }
    }
}
