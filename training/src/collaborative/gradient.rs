//! Gradient mode: each batch's gradient accumulated until the swarm has its global batch,
//! then one averaging round (or, with the delayed update, one in the background) and the
//! shared optimizer step; `try_step` for a peer that waits without adding samples.

use super::state::Lone;
use super::*;

impl CollaborativeOptimizer {
    pub(super) async fn gradient_step(
        &mut self,
        params: &mut ParamSet,
        batch_samples: u64,
    ) -> Result<StepReport, TrainingError> {
        let k = batch_samples as f32;
        self.accumulated
            .iter_mut()
            .zip(params.grads())
            .for_each(|(a, g)| *a += k * g);
        // While a delayed update's round is in flight this peer's published progress stays
        // that of the epoch the round ends (see `delayed`).
        if self.pending.is_none() {
            let local = self.local_progress();
            if !self.tracker.due(&local) {
                self.collect_publication()?;
            } else if self.publish_took.slow() {
                // A slow network: the report goes out beside compute (one at a time; a report
                // due while the last is in flight waits for the next batch).
                self.collect_publication()?;
                if self.publishing.is_none() {
                    self.spawn_publication();
                }
            } else {
                self.settle_publication().await?;
                let started = Instant::now();
                let reported = self.tracker.publish(local).await;
                self.publish_took.note(started.elapsed());
                self.tolerate(reported)?;
            }
        }
        self.try_global_step(params).await
    }

    /// Gradient mode, for a peer with no more batches this epoch (or that wants to wait for the
    /// swarm): takes the global step if the swarm has its batch, without adding samples.
    /// Returns at once either way; call it again (after a pause) until `stepped`.
    pub async fn try_step(&mut self, params: &mut ParamSet) -> Result<StepReport, TrainingError> {
        same_len(self.len, params)?;
        match self.cfg.mode {
            Mode::Gradients => {
                let last = self.final_progress();
                let reported = if self.pending.is_none() {
                    self.settle_publication().await?;
                    self.tracker.report_final(last).await
                } else {
                    Ok(false)
                };
                let report = match self.tolerate(reported) {
                    Ok(_) => self.try_global_step(params).await,
                    Err(e) => Err(e),
                };
                let report = self.with_errors(report);
                self.record(&report);
                report
            }
            Mode::LocalSgd { .. } => Ok(self.idle_report()),
        }
    }

    pub(super) fn idle_report(&self) -> StepReport {
        StepReport {
            epoch: self.epoch,
            stepped: false,
            group_size: None,
            averaging_error: None,
            errors: Vec::new(),
            state_checked: false,
            state_averaged: false,
            samples: self.samples,
            swarm: self.swarm.as_ref().map(|(_, s)| s.clone()),
            behind: false,
            others_epoch: None,
            round: None,
            gossip: None,
            timings: StepTimings::default(),
        }
    }

    /// Steps if the swarm (or this peer alone) has the global batch: averages the mean
    /// gradient with the group, weighted by samples, and applies the shared optimizer step.
    async fn try_global_step(
        &mut self,
        params: &mut ParamSet,
    ) -> Result<StepReport, TrainingError> {
        // Delayed update: a round that finished meanwhile is applied first. While one is in
        // flight the swarm's reports of the next epoch cannot be in yet (every member of the
        // round publishes when its round ends): nothing to read unless this peer alone has the
        // batch.
        let mut applied = self.apply_if_finished(params).await?;
        if let Some(r) = applied.take_if(|r| r.behind) {
            // The round just ended found the others an epoch on: the caller syncs first.
            return Ok(r);
        }
        self.catch_up();
        match self.round_in_flight(params).await? {
            delayed::InFlight::Computing => {
                return Ok(applied.unwrap_or_else(|| self.idle_report()));
            }
            delayed::InFlight::Settled(Some(r)) if r.behind => return Ok(*r),
            delayed::InFlight::Settled(r) => applied = r.map(|r| *r).or(applied),
        }
        let read_at = Instant::now();
        let mut swarm = self.swarm_progress().await?;
        tracing::trace!(
            reading_ms = read_at.elapsed().as_secs_f64() * 1e3,
            "swarm progress"
        );
        self.take_swarm_epoch(&swarm);
        let ready = self.batch_ready(&swarm);
        if ready
            && (swarm.peers_in_epoch < swarm.peers || self.state_due() || self.state_due_next())
        {
            // About to average while a live peer's report of this epoch is missing (it may
            // have stepped a moment ago), or in a round that would carry the state (a joiner
            // that synced at epoch E while its donor stepped to E + 1 alone would average the
            // state while the donor does not), or in the round before one (a peer an epoch
            // behind would average gradients while the others average the state): read
            // again, so that this peer agrees with the others on the epoch, and so on which
            // rounds carry the state.
            self.swarm = None;
            swarm = self.swarm_progress().await?;
            self.take_swarm_epoch(&swarm);
        }
        let behind = swarm.is_behind(self.epoch);
        let mut report = self.idle_report();
        report.swarm = Some(swarm);
        report.behind = behind;
        if behind && self.fresh_sync.is_some() {
            // The state just synced is already an epoch old (the donor stepped meanwhile):
            // averaging with the swarm would apply its gradients to older parameters. The
            // caller syncs again (`behind`); it does not step meanwhile.
            return Ok(applied.unwrap_or(report));
        }
        if !ready || self.samples == 0 {
            if let Some(swarm) = &report.swarm {
                self.schedule_matchmaking(swarm);
            }
            return Ok(applied.unwrap_or(report));
        }
        // Rounds apply in order: the one in flight (delayed update) before this one starts.
        if let Some(r) = self.apply_pending(params).await? {
            if r.behind {
                return Ok(r);
            }
            applied = Some(r);
        }
        // The local mean gradient, averaged with the group's weighted by samples: the global
        // batch's mean gradient.
        let scale = 1.0 / self.samples as f32;
        params
            .grads_mut()
            .iter_mut()
            .zip(&self.accumulated)
            .for_each(|(g, a)| *g = a * scale);
        if let Some(beta) = self.cfg.worker_momentum {
            // What this peer contributes is its momentum (see the config's docs). A round that
            // fails, or finds this peer behind, keeps it: it is this peer's own history.
            self.momentum.resize(self.len, 0.0);
            self.momentum
                .iter_mut()
                .zip(params.grads_mut())
                .for_each(|(m, g)| {
                    *m = beta * *m + *g;
                    *g = *m;
                });
        }
        // Held off new joiners from the look for them until this step's state is served; let
        // go at once on any return before that.
        let mut hold = None;
        if report.swarm.as_ref().is_some_and(|s| s.peers <= 1) {
            // Alone, but perhaps a joiner is fetching this peer's state: it joins this round.
            match self.wait_for_joiners().await? {
                Lone::Joined(swarm) => report.swarm = Some(swarm),
                Lone::Alone(held) => hold = held,
            }
        }
        // Every live peer searches about now: a group of them need not wait out the window.
        self.averager
            .expect_peers(swarm_peers(report.swarm.as_ref()));
        self.grace_for_batches();
        // Peers in another epoch never group (one a round behind would average gradients of
        // other parameters): it learns at its search that it is behind.
        self.averager.set_round_tag(self.epoch);
        let began = Instant::now();
        report.timings.waiting = self.epoch_start.map_or(Duration::ZERO, |t| began - t);
        let deadline = began + self.cfg.averaging_timeout;
        // No other live peer in the run's progress (a run's first peer, before anyone joins):
        // searching would only wait out a matchmaking window.
        let alone = report.swarm.as_ref().is_some_and(|s| s.peers <= 1);
        // Every `state_averaging_every` epochs the same round also averages the parameters and
        // the optimizer state, so that peers whose earlier rounds failed or ran in smaller
        // groups meet again. In the gradient round itself, not in a second round after the
        // step: every peer in an epoch averages the same tensors, so a peer never waits out a
        // matchmaking window for one that is averaging something else.
        let with_state = self.state_due();
        let weight = self.samples as f32;
        if self.cfg.delayed_update && !alone {
            compressor(&mut self.compressor, &self.compressor_spec)?;
            let mut grads = std::mem::take(&mut self.spare);
            grads.resize(self.len, 0.0);
            grads.copy_from_slice(params.grads());
            report.samples = self.samples;
            self.launch(
                params,
                delayed::Launch {
                    grads,
                    with_state,
                    weight,
                    deadline,
                    report,
                },
            );
            self.accumulated.fill(0.0);
            self.samples = 0;
            self.swarm = None;
            self.epoch_start = None;
            // Published when the round ends (`apply_pending`): a report of the next epoch now
            // would tell the peers still about to start this round that they are behind.
            return Ok(applied.unwrap_or_else(|| self.idle_report()));
        }
        if let Some(r) = applied {
            // A delayed round applied just now, and this step (alone) taken at once: both
            // steps happened; the report is this one's, with the other's failures.
            report.errors.extend(r.errors);
        }
        if alone {
            // A search started ahead would form a group nobody steps in.
            self.averager.cancel_prepared();
            report.averaging_error = Some(ALONE.into());
        } else {
            let averaged = average_gradients(
                &self.averager,
                compressor(&mut self.compressor, &self.compressor_spec)?,
                self.cfg.error_feedback.then_some(&mut self.residuals),
                params.grads_mut(),
                weight,
                deadline,
            )
            .await;
            // The parameters and the optimizer state, in the same group, weighted by samples
            // like the gradients; sent only if some member's differ from the others' (see
            // `reconcile_state`).
            let exact = self.exact_rounds();
            let state =
                with_state.then(|| state_buffers(params.params_mut(), self.optimizer.state_mut()));
            let reconciled =
                reconcile_state(&self.averager, &averaged, exact, state, weight, deadline).await;
            let mut ahead = behind_of(&averaged);
            note_round(&mut report, averaged)?;
            note_reconciled(&mut report, reconciled)?;
            self.learn_matchmaking(&report);
            if ahead.is_none() && report.round.is_none() {
                ahead = self.others_moved_on(self.epoch).await?;
            }
            if let Some(theirs) = ahead {
                // The others are past this epoch: applying its gradients here would leave
                // this peer's parameters apart from theirs. No step; the caller syncs.
                self.note_behind(&mut report, theirs);
                return Ok(report);
            }
        }
        let averaged_at = Instant::now();
        report.timings.averaging = averaged_at - began;
        self.schedule_lr(self.epoch);
        self.optimizer.step_set(params)?;
        self.epoch += 1;
        self.fresh_sync = None;
        self.accumulated.fill(0.0);
        self.samples = 0;
        if let Some(r) = report
            .round
            .as_ref()
            .filter(|_| report.averaging_error.is_none())
        {
            self.joiners_in_round(&r.group);
        }
        let stepped_ms = starling_dht::now_ms();
        let now = Instant::now();
        let epoch_took = self.last_stepped.map_or(Duration::MAX, |t| now - t);
        self.last_stepped = Some(now);
        self.swarm = if self.watching_for_joiners() {
            None
        } else {
            self.progress_after_round(&report, stepped_ms)
        };
        self.round_began = self.swarm.as_ref().map(|(_, s)| (stepped_ms, s.clone()));
        // A round that held every live peer (the reading made up from it) covers the new
        // epoch: its members know each other's epoch, and this peer's report of it can wait
        // (not the last epoch's: joiners of an ended run read it). Only after a few such rounds
        // in a row: a joiner's first rounds find the others' epoch in their reports, not made
        // up, and a report held back then left it computing the whole batch (1400 samples a
        // peer for 2048). And only where it saves writes, in epochs shorter than half the
        // covered report interval (stride above 1); with longer ones every epoch is published
        // anyway.
        self.full_rounds = if self.swarm.is_some() {
            self.full_rounds + 1
        } else {
            0
        };
        let stride = covered_stride(epoch_took);
        let covered = self
            .swarm
            .as_ref()
            .filter(|_| self.full_rounds > 3 && stride > 1)
            .and(report.round.as_ref())
            .filter(|_| self.cfg.final_epoch.is_none_or(|last| self.epoch < last))
            .map(|r| Covered {
                epoch: self.epoch,
                peers: r.group.clone(),
                since_ms: stepped_ms,
                stride,
            });
        self.tracker.cover(covered);
        self.schedule_after_step();
        report.timings.optimizer = averaged_at.elapsed();
        self.epoch_start = None;
        let stepped_at = Instant::now();
        self.refresh_served_state(params, hold).await;
        // The others learn of the new epoch now.
        self.publish_in_background().await?;
        tracing::debug!(
            epoch = self.epoch,
            averaging_ms = report.timings.averaging.as_secs_f64() * 1e3,
            matchmaking_ms = report
                .round
                .as_ref()
                .map_or(0.0, |r| r.matchmaking_time.as_secs_f64() * 1e3),
            prepared = report.round.as_ref().is_some_and(|r| r.prepared),
            optimizer_ms = report.timings.optimizer.as_secs_f64() * 1e3,
            serving_ms = stepped_at.elapsed().as_secs_f64() * 1e3,
            "global step taken"
        );
        report.epoch = self.epoch;
        report.stepped = true;
        Ok(report)
    }
}
