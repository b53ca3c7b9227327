//! The delayed parameter update ([`CollaborativeConfig::delayed_update`]): an epoch's averaging
//! round runs as a background task on owned copies of what it averages, while the caller
//! computes the next epoch's batches; its optimizer step is applied at the first call that
//! finds it finished, or before the next round starts (rounds apply in order, one in flight at
//! a time).
//!
//! The parameters do not change between a round's start and its application (this peer takes
//! no other step meanwhile), so a round that also carries the state averages the same values a
//! synchronous round would have, and applying its results writes back exactly what the averager
//! wrote.
//!
//! This peer publishes its progress in the next epoch only when the round has ended, as a
//! synchronous peer does after its step: a report of the next epoch while the round is still
//! forming would tell the peers about to start it that they are behind. Meanwhile its samples
//! count towards the next epoch locally.
//!
//! Which parameters a batch computed during the round sees depends on when the round ends
//! (before or after its application): the gradients are up to one step stale. Every peer still
//! applies the same averaged gradients to the same parameters.
//!
//! [`CollaborativeConfig::delayed_update`]: super::CollaborativeConfig::delayed_update

use std::sync::Arc;
use std::time::{Duration, Instant};

use starling_averager::{AveragerError, Reconciliation, Residuals, RoundReport};
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::{
    average_gradients, behind_of, note_reconciled, note_round, reconcile_state,
    CollaborativeOptimizer, Compressor, StepReport, TrainingError,
};
use crate::params::ParamSet;

/// A round in flight.
pub(super) struct Pending {
    task: JoinHandle<Finished>,
    /// The report of the step, filled in when it is applied.
    report: StepReport,
    /// The epoch the step reaches.
    epoch_after: u64,
    /// When the round was launched (Unix ms): when the next epoch began for its members.
    launched_ms: u64,
    /// The averager's `searches_done` before the round began: once it has grown, the round's
    /// group has formed, and the next round's search may start beside its all-reduce.
    searches_before: u64,
}

/// What a background round hands back.
pub(super) struct Finished {
    /// The mean gradient, averaged with the group on the spans the round covered.
    grads: Vec<f32>,
    /// The parameters and the optimizer state, when the round carried them.
    state: Option<(Vec<f32>, Vec<Vec<f32>>)>,
    /// The error-feedback residuals the round took along.
    residuals: Option<Residuals>,
    /// The compressor the round took along.
    compressor: Option<Compressor>,
    result: Result<RoundReport, AveragerError>,
    /// What reconciling the state did, when the round carried it and formed a group.
    reconciled: Option<Result<Reconciliation, AveragerError>>,
    took: Duration,
}

/// What a round to start averages and how.
pub(super) struct Launch {
    /// The mean gradient of this peer's samples (the buffer moves into the task).
    pub grads: Vec<f32>,
    /// Whether the round also averages the parameters and the optimizer state.
    pub with_state: bool,
    pub weight: f32,
    pub deadline: Instant,
    /// The report of the step so far (progress, waiting time).
    pub report: StepReport,
}

/// Where a call stands with a delayed update's round in flight ([`CollaborativeOptimizer::round_in_flight`]).
pub(super) enum InFlight {
    /// This peer's share of the batch is not in: it computes on while the round runs.
    Computing,
    /// No round is in flight any more: the one applied now, if any, and its report.
    Settled(Option<Box<StepReport>>),
}

impl CollaborativeOptimizer {
    /// Starts `launch`'s round in the background and moves this peer to the next epoch: the
    /// samples it computes from now on count towards that one.
    pub(super) fn launch(&mut self, params: &ParamSet, launch: Launch) {
        let Launch {
            mut grads,
            with_state,
            weight,
            deadline,
            report,
        } = launch;
        let mut state = with_state.then(|| {
            let optimizer: Vec<Vec<f32>> = self
                .optimizer
                .state_mut()
                .into_iter()
                .map(|(_, b)| b.to_vec())
                .collect();
            (params.params().to_vec(), optimizer)
        });
        // The gradients' residual goes with the round and comes back with it.
        let mut residuals = self
            .cfg
            .error_feedback
            .then(|| std::mem::take(&mut self.residuals));
        // (Built by the caller if a dropped round took it.)
        let mut compressor = self.compressor.take();
        let exact = self.exact_rounds();
        let averager = Arc::clone(&self.averager);
        let searches_before = averager.searches_done();
        let task = tokio::spawn(
            async move {
                let began = Instant::now();
                let result = average_gradients(
                    &averager,
                    compressor.as_mut(),
                    residuals.as_mut(),
                    &mut grads,
                    weight,
                    deadline,
                )
                .await;
                // The state (a copy taken at the launch: the parameters change only when
                // this round is applied), after the gradients in the same group.
                let buffers = state.as_mut().map(|(values, optimizer)| {
                    let mut buffers: Vec<&mut [f32]> = vec![&mut values[..]];
                    buffers.extend(optimizer.iter_mut().map(|b| &mut b[..]));
                    buffers
                });
                let reconciled =
                    reconcile_state(&averager, &result, exact, buffers, weight, deadline).await;
                Finished {
                    grads,
                    state,
                    residuals,
                    compressor,
                    result,
                    reconciled,
                    took: began.elapsed(),
                }
            }
            .in_current_span(),
        );
        self.epoch += 1;
        self.pending = Some(Pending {
            task,
            report,
            epoch_after: self.epoch,
            launched_ms: starling_dht::now_ms(),
            searches_before,
        });
    }

    /// Whether the round in flight, if any, has formed its group (or failed to): the next
    /// round's search may then start beside its all-reduce.
    pub(super) fn pending_searched(&self) -> bool {
        self.pending
            .as_ref()
            .is_some_and(|p| self.averager.searches_done() > p.searches_before)
    }

    /// A call while a delayed update's round is in flight. Until the swarm is projected to
    /// have computed `delayed_max_stale` of the next batch (and, with a bound of 1, until this
    /// peer's share of it is in), it computes on (and, once the round's group has formed, the
    /// next round's search may start beside its all-reduce). Past that, while the round still
    /// runs, it waits for that round rather than compute more of the next gradient on the
    /// parameters before it (with its share in: rather than compute past the batch it was
    /// asked for; the others do the same), starting the next search as soon as the round's
    /// group has formed, and applies it.
    pub(super) async fn round_in_flight(
        &mut self,
        params: &mut ParamSet,
    ) -> Result<InFlight, TrainingError> {
        if self.pending.is_none() {
            return Ok(InFlight::Settled(None));
        }
        if !self.share_ready() && !self.staleness_bound_reached() {
            self.schedule_beside_pending();
            return Ok(InFlight::Computing);
        }
        if self.pipelined_progress_possible() {
            while self.pending.as_ref().is_some_and(|p| !p.task.is_finished())
                && !self.pending_searched()
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            self.schedule_beside_pending();
        }
        Ok(InFlight::Settled(
            self.apply_pending(params).await?.map(Box::new),
        ))
    }

    /// Applies the round in flight if it has finished; `None` when none was (or it still runs).
    pub(super) async fn apply_if_finished(
        &mut self,
        params: &mut ParamSet,
    ) -> Result<Option<StepReport>, TrainingError> {
        if self.pending.as_ref().is_some_and(|p| p.task.is_finished()) {
            return self.apply_pending(params).await;
        }
        Ok(None)
    }

    /// Waits for the round in flight, if any, and applies its step: the averaged state (when
    /// it carried it), then the optimizer step with the averaged gradient.
    pub(super) async fn apply_pending(
        &mut self,
        params: &mut ParamSet,
    ) -> Result<Option<StepReport>, TrainingError> {
        let Some(pending) = self.pending.take() else {
            return Ok(None);
        };
        let mut report = pending.report;
        let finished = match pending.task.await {
            Ok(f) => f,
            Err(e) => {
                // Only a panic in the averager gets here (nothing else aborts a pending round
                // while it is held): the gradients went with it, so this epoch takes no step.
                let e = format!("the background averaging round failed: {e}");
                tracing::warn!("{e}");
                report.errors.push(e.clone());
                report.averaging_error = Some(e);
                report.epoch = pending.epoch_after;
                report.stepped = true;
                return Ok(Some(report));
            }
        };
        if let Some(r) = finished.residuals {
            self.residuals = r;
        }
        if let Some(c) = finished.compressor {
            self.compressor = Some(c);
        }
        let mut ahead = behind_of(&finished.result);
        note_round(&mut report, finished.result)?;
        note_reconciled(&mut report, finished.reconciled)?;
        self.learn_matchmaking(&report);
        report.timings.averaging = finished.took;
        if ahead.is_none() && report.round.is_none() {
            ahead = self.others_moved_on(pending.epoch_after - 1).await?;
        }
        if let Some(theirs) = ahead {
            // The others had taken this step already (with this peer, or without it in a
            // round that failed here): not applied (the parameters stay those the round
            // started from); the caller syncs.
            self.spare = finished.grads;
            self.epoch = pending.epoch_after - 1;
            self.note_behind(&mut report, theirs);
            return Ok(Some(report));
        }
        let applied_at = Instant::now();
        if let Some((values, optimizer)) = finished.state.filter(|_| report.state_averaged) {
            // Spans the round did not cover hold this peer's own values: nothing changed them.
            params.params_mut().copy_from_slice(&values);
            for ((_, dst), src) in self.optimizer.state_mut().into_iter().zip(&optimizer) {
                dst.copy_from_slice(src);
            }
        }
        self.schedule_lr(pending.epoch_after - 1);
        self.optimizer.step(params.params_mut(), &finished.grads)?;
        report.timings.optimizer = applied_at.elapsed();
        self.spare = finished.grads;
        self.refresh_served_state(params, None).await;
        // Every member launched the round, and began this epoch, about when this peer did.
        let made_up = self.progress_after_round(&report, pending.launched_ms);
        self.round_began = made_up
            .as_ref()
            .map(|(_, s)| (pending.launched_ms, s.clone()));
        if self
            .swarm
            .as_ref()
            .is_none_or(|(_, s)| s.epoch != self.epoch)
        {
            // Over a slow network the next batch then need not wait for a DHT read.
            self.swarm = made_up;
            self.tracker.cover(None);
        }
        // Now the others may read that this peer moved on (every member of the round has
        // started it by now), with the samples it computed meanwhile.
        self.publish_in_background().await?;
        report.epoch = pending.epoch_after;
        report.stepped = true;
        Ok(Some(report))
    }

    /// Drops the round in flight, if any, without applying it (the state is being replaced),
    /// and a search started ahead;
    /// [`CollaborativeOptimizer::shutdown`] waits for it to end.
    pub(super) fn cancel_pending(&mut self) {
        // A search started ahead was for the epoch being left.
        self.averager.cancel_prepared();
        // Rounds dropped earlier that have ended need no waiting for: the list stays short.
        self.cancelled.retain(|t| !t.is_finished());
        if let Some(p) = self.pending.take() {
            p.task.abort();
            self.cancelled.push(p.task);
        }
    }

    /// Waits for the round in flight, if any, and applies its step, so that the parameters are
    /// those of [`epoch`](CollaborativeOptimizer::epoch): call it before evaluating, saving a
    /// checkpoint or reading the result, with [`CollaborativeConfig::delayed_update`]
    /// (otherwise there is never a round in flight and it returns `None`). Returns the report
    /// of the step it applied.
    ///
    /// ```no_run
    /// # async fn demo(mut opt: starling_training::CollaborativeOptimizer, mut params: starling_training::ParamSet) -> Result<(), starling_training::TrainingError> {
    /// if let Some(report) = opt.flush(&mut params).await? {
    ///     println!("epoch {} applied", report.epoch);
    /// }
    /// assert_eq!(opt.params_epoch(), opt.epoch());
    /// # Ok(()) }
    /// ```
    ///
    /// [`CollaborativeConfig::delayed_update`]: super::CollaborativeConfig::delayed_update
    pub async fn flush(
        &mut self,
        params: &mut ParamSet,
    ) -> Result<Option<StepReport>, TrainingError> {
        let Some(report) = self.apply_pending(params).await? else {
            return Ok(None);
        };
        let report = self.with_errors(Ok(report));
        self.record(&report);
        report.map(Some)
    }

    /// The epoch the parameters are at: [`epoch`](CollaborativeOptimizer::epoch), less one
    /// while a delayed update is in flight (its samples were counted, its step not yet
    /// applied). A checkpoint saves this one.
    pub fn params_epoch(&self) -> u64 {
        self.epoch - u64::from(self.pending.is_some())
    }

    /// Waits for every background round to end (shutdown).
    pub(super) async fn end_background_rounds(&mut self) {
        self.cancel_pending();
        for t in self.cancelled.drain(..) {
            let _ = t.await;
        }
    }
}
