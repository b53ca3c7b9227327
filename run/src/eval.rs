//! Evaluations beside training: [`BackgroundEval`] evaluates a snapshot of the parameters on a
//! model copy at idle priority, so that a peer does not hold its swarm up while it evaluates.

use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use starling_training::{ParamSet, VarBinding};

use crate::data::Dataset;
use crate::manifest::{ModelSpec, RunManifest};
use crate::model::{Eval, Net};

/// A second copy of the model that evaluates a snapshot of the parameters on a thread of its own,
/// at idle priority, while training goes on: a peer no longer holds its swarm up while it
/// evaluates. In a glyphs MLP pair (a core each) each of the six evaluations stopped both
/// peers for about 10 ms (the partner waited in the round); now the evaluating peer's core gives
/// the evaluation the time it would idle (waiting in rounds) and the partner computes on. On a
/// peer whose core never idles (one training alone on one core), an evaluation still pending when
/// the next one is due (or when the run ends) is waited for, as before.
pub(crate) struct BackgroundEval {
    net: Arc<dyn Net>,
    binding: VarBinding,
    pending: Option<(u64, tokio::sync::oneshot::Receiver<Result<Eval>>)>,
}

impl BackgroundEval {
    /// A copy of the manifest's model for evaluations, if it has no remote layer.
    pub(crate) fn new(m: &RunManifest, data: &Dataset) -> Option<Self> {
        if matches!(m.model, ModelSpec::Charlm { moe: Some(_), .. }) {
            return None;
        }
        let built = crate::model::build(m, data, None).ok()?;
        Some(BackgroundEval {
            net: built.net,
            binding: built.binding,
            pending: None,
        })
    }

    /// Starts evaluating `params` (of `epoch`); the one still pending, if any, is waited for
    /// first and returned.
    pub(crate) async fn start(
        &mut self,
        epoch: u64,
        params: &ParamSet,
        data: &Arc<Dataset>,
    ) -> Result<Option<(u64, Eval)>> {
        let earlier = self.wait().await?;
        self.binding.params_to_vars(params)?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (net, data) = (self.net.clone(), data.clone());
        std::thread::Builder::new()
            .name("starling-eval".into())
            .spawn(move || {
                lower_priority();
                let _ = tx.send(net.evaluate(&data));
            })
            .context("starting an evaluation thread")?;
        self.pending = Some((epoch, rx));
        Ok(earlier)
    }

    /// The pending evaluation's result if it has ended (without waiting).
    pub(crate) fn ready(&mut self) -> Result<Option<(u64, Eval)>> {
        let Some((epoch, rx)) = self.pending.as_mut() else {
            return Ok(None);
        };
        match rx.try_recv() {
            Ok(eval) => {
                let epoch = *epoch;
                self.pending = None;
                Ok(Some((epoch, eval?)))
            }
            Err(tokio::sync::oneshot::error::TryRecvError::Empty) => Ok(None),
            Err(tokio::sync::oneshot::error::TryRecvError::Closed) => {
                self.pending = None;
                Err(ended())
            }
        }
    }

    /// Waits for the pending evaluation, if any.
    pub(crate) async fn wait(&mut self) -> Result<Option<(u64, Eval)>> {
        let Some((epoch, rx)) = self.pending.take() else {
            return Ok(None);
        };
        let eval = rx.await.map_err(|_| ended())??;
        Ok(Some((epoch, eval)))
    }
}

/// Puts the calling thread at idle priority (`SCHED_IDLE`, Linux): it runs only when its core
/// would otherwise idle. Elsewhere, or if refused, it keeps its priority.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: plain syscall on the calling thread (0), with a valid parameter.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
        if rc != 0 {
            tracing::debug!(
                "evaluation thread: SCHED_IDLE refused ({})",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// The error of an evaluation thread that ended without sending its result (it panicked).
fn ended() -> anyhow::Error {
    anyhow!("the evaluation thread ended without a result")
}
