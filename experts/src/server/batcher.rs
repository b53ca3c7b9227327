//! The task pool: each hosted expert has a bounded queue of forward tasks and one of backward
//! tasks, and a batcher task per queue that groups waiting tasks into batches for the runtime.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::Tensor;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::runtime::Job;
use super::ServerConfig;
use crate::error::{RemoteError, RemoteErrorKind};

/// What a task's submitter receives: the task's rows of the batch result, or an error.
pub(super) type TaskResult = std::result::Result<Tensor, RemoteError>;
/// Where a task's result goes.
pub(super) type Reply = oneshot::Sender<TaskResult>;

/// One request's work, waiting in a pool.
pub(super) struct Task {
    /// `[rows, ..input shape]`.
    pub(super) inputs: Tensor,
    /// For a backward: the output gradients, `[rows, ..output shape]`.
    pub(super) grads: Option<Tensor>,
    /// Samples in this task.
    pub(super) rows: usize,
    pub(super) reply: Reply,
}

/// Which pass a task asks for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Kind {
    /// Outputs for the inputs.
    Forward,
    /// Input gradients, and an optimizer step.
    Backward,
}

/// One expert's queue of forward or backward tasks.
#[derive(Clone)]
pub(super) struct Pool {
    pub(super) tx: mpsc::Sender<Task>,
    /// Samples queued and not yet taken by the batcher (the bound is on samples, not tasks).
    pub(super) queued_rows: Arc<AtomicUsize>,
    pub(super) max_queue_rows: usize,
}

impl Pool {
    /// An empty queue bounded by `cfg.max_queue_rows`, and the receiving end for its batcher.
    pub(super) fn new(cfg: &ServerConfig) -> (Pool, mpsc::Receiver<Task>) {
        let (tx, rx) = mpsc::channel(cfg.max_queue_rows.min(65_536));
        let pool = Pool {
            tx,
            queued_rows: Arc::new(AtomicUsize::new(0)),
            max_queue_rows: cfg.max_queue_rows,
        };
        (pool, rx)
    }

    /// Queues `task`, or refuses it with `Overloaded` when the queue holds `max_queue_rows`
    /// samples (or tasks) already.
    pub(super) fn submit(&self, task: Task) -> std::result::Result<(), RemoteError> {
        let rows = task.rows;
        let before = self.queued_rows.fetch_add(rows, Ordering::AcqRel);
        if before + rows > self.max_queue_rows {
            self.queued_rows.fetch_sub(rows, Ordering::AcqRel);
            return Err(RemoteError::new(
                RemoteErrorKind::Overloaded,
                format!(
                    "{before} samples already queued (limit {})",
                    self.max_queue_rows
                ),
            ));
        }
        self.tx.try_send(task).map_err(|_| {
            self.queued_rows.fetch_sub(rows, Ordering::AcqRel);
            RemoteError::new(RemoteErrorKind::Overloaded, "queue full")
        })
    }
}

/// Collects tasks into batches of at most `max_batch_rows`, waiting at most `max_wait` after the
/// first, and hands them to the runtime (waiting for room: backpressure).
pub(super) async fn batcher(
    uid: Arc<str>,
    kind: Kind,
    mut rx: mpsc::Receiver<Task>,
    queued_rows: Arc<AtomicUsize>,
    runtime: mpsc::Sender<Job>,
    cfg: ServerConfig,
    mut stop: watch::Receiver<bool>,
) {
    let mut carry: Option<Task> = None;
    loop {
        let first = match carry.take() {
            Some(t) => t,
            None => tokio::select! {
                t = rx.recv() => match t { Some(t) => t, None => return },
                _ = stop.changed() => return,
            },
        };
        queued_rows.fetch_sub(first.rows, Ordering::AcqRel);
        let mut rows = first.rows;
        let mut batch = vec![first];
        let until = Instant::now() + cfg.max_wait;
        while rows < cfg.max_batch_rows {
            let next = match rx.try_recv() {
                Ok(t) => t,
                Err(mpsc::error::TryRecvError::Empty) => {
                    match tokio::time::timeout_at(until, rx.recv()).await {
                        Ok(Some(t)) => t,
                        _ => break,
                    }
                }
                Err(_) => break,
            };
            queued_rows.fetch_sub(next.rows, Ordering::AcqRel);
            if rows + next.rows > cfg.max_batch_rows {
                // Counted as taken; give the count back while it waits for the next batch.
                queued_rows.fetch_add(next.rows, Ordering::AcqRel);
                carry = Some(next);
                break;
            }
            rows += next.rows;
            batch.push(next);
        }
        batch.retain(|t| !t.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        let job = Job::Run {
            uid: uid.clone(),
            kind,
            tasks: batch,
        };
        tokio::select! {
            r = runtime.send(job) => if r.is_err() { return },
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use std::time::Duration;

    fn task(rows: usize) -> (Task, oneshot::Receiver<TaskResult>) {
        let (tx, rx) = oneshot::channel();
        let t = Task {
            inputs: Tensor::zeros((rows, 2), candle_core::DType::F32, &Device::Cpu).unwrap(),
            grads: None,
            rows,
            reply: tx,
        };
        (t, rx)
    }

    #[test]
    fn a_pool_refuses_work_beyond_its_bound() {
        let (tx, mut rx) = mpsc::channel(100);
        let pool = Pool {
            tx,
            queued_rows: Arc::new(AtomicUsize::new(0)),
            max_queue_rows: 10,
        };
        let mut replies = Vec::new();
        for _ in 0..2 {
            let (t, r) = task(4);
            replies.push(r);
            assert!(pool.submit(t).is_ok());
        }
        let (t, _r) = task(4);
        let err = pool.submit(t).unwrap_err();
        assert_eq!(err.kind, RemoteErrorKind::Overloaded);
        assert_eq!(pool.queued_rows.load(Ordering::Acquire), 8);
        // Once the batcher takes work, room frees up.
        let taken = rx.try_recv().unwrap();
        pool.queued_rows.fetch_sub(taken.rows, Ordering::AcqRel);
        let (t, _r) = task(4);
        assert!(pool.submit(t).is_ok());
    }

    #[tokio::test]
    async fn the_batcher_groups_tasks_up_to_the_batch_limit() {
        let (tx, rx) = mpsc::channel(100);
        let queued = Arc::new(AtomicUsize::new(0));
        let pool = Pool {
            tx,
            queued_rows: queued.clone(),
            max_queue_rows: 1000,
        };
        let mut replies = Vec::new();
        for _ in 0..5 {
            let (t, r) = task(3);
            replies.push(r);
            pool.submit(t).unwrap();
        }
        let (rt_tx, mut rt_rx) = mpsc::channel(10);
        let (_stop_tx, stop_rx) = watch::channel(false);
        let cfg = ServerConfig {
            max_batch_rows: 8,
            max_wait: Duration::from_millis(20),
            ..ServerConfig::default()
        };
        let handle = tokio::spawn(batcher(
            Arc::from("e.0"),
            Kind::Forward,
            rx,
            queued.clone(),
            rt_tx,
            cfg,
            stop_rx,
        ));
        let mut sizes = Vec::new();
        while sizes.iter().sum::<usize>() < 15 {
            match rt_rx.recv().await.unwrap() {
                Job::Run { tasks, kind, .. } => {
                    assert_eq!(kind, Kind::Forward);
                    sizes.push(tasks.iter().map(|t| t.rows).sum());
                }
                _ => panic!("unexpected job"),
            }
        }
        assert_eq!(sizes, vec![6, 6, 3]);
        assert_eq!(queued.load(Ordering::Acquire), 0);
        handle.abort();
    }

    #[tokio::test]
    async fn abandoned_tasks_are_not_run_and_stop_ends_the_batcher() {
        let cfg = ServerConfig {
            max_batch_rows: 100,
            max_wait: Duration::from_millis(20),
            ..ServerConfig::default()
        };
        let (pool, rx) = Pool::new(&cfg);
        let (kept, kept_reply) = task(2);
        let (abandoned, abandoned_reply) = task(5);
        drop(abandoned_reply); // its client went away (timed out, stream closed)
        pool.submit(kept).unwrap();
        pool.submit(abandoned).unwrap();
        let (rt_tx, mut rt_rx) = mpsc::channel(10);
        let (stop_tx, stop_rx) = watch::channel(false);
        let handle = tokio::spawn(batcher(
            Arc::from("e.0"),
            Kind::Backward,
            rx,
            pool.queued_rows.clone(),
            rt_tx,
            cfg,
            stop_rx,
        ));
        match rt_rx.recv().await.unwrap() {
            Job::Run { tasks, kind, uid } => {
                assert_eq!((&*uid, kind), ("e.0", Kind::Backward));
                assert_eq!(tasks.iter().map(|t| t.rows).collect::<Vec<_>>(), vec![2]);
            }
            _ => panic!("unexpected job"),
        }
        assert_eq!(pool.queued_rows.load(Ordering::Acquire), 0);
        stop_tx.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), handle)
            .await
            .expect("the batcher ends on stop")
            .unwrap();
        drop(kept_reply);
    }
}
