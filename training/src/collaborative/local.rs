//! Local SGD (DiLoCo): a phase of `inner_steps` local steps, then one outer round that
//! averages the pseudo-gradient (where the phase started minus where it went) and, every
//! `state_averaging_every` outer steps, the phase start and the outer optimizer's state too.

use super::*;

impl CollaborativeOptimizer {
    /// One local step; after the phase's last one, the outer round and the outer step.
    pub(super) async fn local_step(
        &mut self,
        params: &mut ParamSet,
        inner_steps: u64,
    ) -> Result<StepReport, TrainingError> {
        self.schedule_lr(self.epoch);
        self.optimizer.step_set(params)?;
        self.inner += 1;
        let reported = self.tracker.report(self.local_progress()).await;
        self.tolerate(reported)?;
        let mut report = self.idle_report();
        if self.inner < inner_steps {
            return Ok(report);
        }
        // The peers that will search with this one: the live ones by their progress.
        let swarm = self.swarm_progress().await.ok();
        self.averager.expect_peers(swarm_peers(swarm.as_ref()));
        report.behind = swarm.as_ref().is_some_and(|s| s.is_behind(self.epoch));
        report.swarm = swarm;
        self.catch_up();
        self.averager.set_round_tag(self.epoch);
        let with_state = self.state_due();
        let exact = self.exact_rounds();
        let Some((outer, anchor)) = self.outer.as_mut() else {
            return Ok(report);
        };
        // The pseudo-gradient: where the phase started minus where the local steps went.
        let delta = &mut self.accumulated;
        delta
            .iter_mut()
            .zip(anchor.iter().zip(params.params()))
            .for_each(|(d, (a, p))| *d = a - p);
        let deadline = Instant::now() + self.cfg.averaging_timeout;
        let weight = self.samples.max(1) as f32;
        let mut ahead = None;
        if let Some(gossip) = &self.gossip {
            // The phase start and the pseudo-gradient mix together, so the outer step below
            // starts from values that move towards the swarm's.
            let mut both: [&mut [f32]; 2] = [&mut anchor[..], &mut delta[..]];
            let averaged = gossip.step(&mut both, weight, deadline).await;
            note_gossip(&mut report, averaged)?;
        } else {
            let averaged = average_gradients(
                &self.averager,
                compressor(&mut self.compressor, &self.compressor_spec)?,
                self.cfg.error_feedback.then_some(&mut self.residuals),
                &mut delta[..],
                weight,
                deadline,
            )
            .await;
            // Every `state_averaging_every` outer steps the group brings its members to one
            // phase start and outer optimizer state, exact (see `reconcile_state`):
            // otherwise a peer whose earlier round ran in a smaller group (a joiner's first
            // ones) or failed keeps its own phase start for good, applying the same averaged
            // step to it (4 DiLoCo peers on the glyphs ended with three different models).
            let state = with_state.then(|| state_buffers(&mut anchor[..], outer.state_mut()));
            let reconciled =
                reconcile_state(&self.averager, &averaged, exact, state, weight, deadline).await;
            ahead = behind_of(&averaged);
            note_round(&mut report, averaged)?;
            note_reconciled(&mut report, reconciled)?;
        }
        if let Some(theirs) = ahead {
            // The others took this outer step already: no step here (the phase's local
            // steps stay in the parameters); the caller syncs.
            self.note_behind(&mut report, theirs);
            return Ok(report);
        }
        // The outer step moves the phase's start along the (averaged) pseudo-gradient; every
        // member continues from there (the same bits with the exact codec).
        outer.step(anchor, delta)?;
        params.params_mut().copy_from_slice(anchor);
        self.epoch += 1;
        self.inner = 0;
        self.samples = 0;
        self.swarm = None;
        self.refresh_served_state(params, None).await;
        let published = self.tracker.publish(self.local_progress()).await;
        self.tolerate(published)?;
        report.epoch = self.epoch;
        report.stepped = true;
        Ok(report)
    }
}
