//! When this peer's share of the global batch is done; the matchmaking scheduled ahead of the
//! round that ends the epoch (what the round will carry, when to start searching, what the last
//! rounds taught about how long matchmaking takes); and the publication of this peer's progress
//! for the next epoch.

use super::*;

impl CollaborativeOptimizer {
    /// Whether the swarm has its global batch by `swarm`: this peer's samples plus the
    /// others' (reported, or projected from their compute rates over the time this peer
    /// computed) reach the target. Each peer then computes about its share, not the whole
    /// batch (a step can take less than one progress read). Our own samples count even if our
    /// report has not reached the others yet.
    pub(super) fn batch_ready(&self, swarm: &SwarmProgress) -> bool {
        let target = self.cfg.target_batch_size;
        // Half a batch ahead: with every peer computing one more batch the swarm would jump
        // past the target by up to a batch per peer; stopping when the target is nearer than
        // half that jump lands the global batch on the target on average, not above it.
        let ahead = self.samples + self.last_batch_samples / 2;
        let mut projection = swarm.projected_with(ahead, self.compute.rate());
        if self.together_epoch == Some(self.epoch) && pace::unmeasured_others(swarm) {
            // The peers began this epoch together (`start_together`): each of the others has
            // computed about what this one has.
            let peers = swarm.peers_in_epoch as u64;
            projection = projection.max(ahead.saturating_mul(peers));
        }
        let projected =
            self.cfg.projected_batch && swarm.epoch == self.epoch && projection >= target;
        tracing::trace!(
            epoch = self.epoch,
            own = self.samples,
            swarm_epoch = swarm.epoch,
            projection,
            own_compute_rate = self.compute.rate(),
            peers_in_epoch = swarm.peers_in_epoch,
            peers = swarm.peers,
            rate = swarm.samples_per_second,
            own_rate = swarm.own_samples_per_second,
            "progress towards the global batch"
        );
        // (A reading of an earlier epoch than this peer's says nothing of this one's batch:
        // this peer's own report may not have reached the DHT yet.)
        (swarm.ready && swarm.epoch >= self.epoch) || self.samples >= target || projected
    }

    /// While a delayed update's round is in flight and has formed its group: starts the next
    /// round's search beside its all-reduce when the projected batch is near, as
    /// [`Self::schedule_matchmaking`] would after the round, from the swarm as the last reading
    /// saw it, now in this epoch with nothing reported. Nothing starts while the round still
    /// searches, with a compressor (the round in flight holds it), in a grid of groups (the
    /// round's end picks the next cell), or with no reading.
    pub(super) fn schedule_beside_pending(&self) {
        if !self.pending_searched() || !self.pipelined_progress_possible() {
            return;
        }
        if let Some(swarm) = self.nothing_reported_yet() {
            self.schedule_matchmaking(&swarm);
        }
    }

    /// The last reading's swarm (its peers and their rates) in this epoch with no samples
    /// reported yet: what a delayed update's round in flight leaves to go on, since the others
    /// publish this epoch only when it ends.
    fn nothing_reported_yet(&self) -> Option<SwarmProgress> {
        let last = self.last_read.as_ref()?;
        Some(SwarmProgress {
            epoch: self.epoch,
            samples: 0,
            own_samples: 0,
            peers_in_epoch: last.peers,
            ..last.clone()
        })
    }

    /// Whether the next round's search may start beside a delayed update's round at all (see
    /// [`Self::schedule_beside_pending`]).
    pub(super) fn pipelined_progress_possible(&self) -> bool {
        self.cfg.scheduled_matchmaking
            && self.compressor_spec.is_none()
            && self.cfg.averager.group_bits == 0
            && self.last_read.is_some()
    }

    /// While a delayed update's round is in flight (the others publish this epoch only when
    /// it ends, so nothing can be read of it): whether this peer has computed its share of the
    /// batch, projected at the rates of the last reading (its own samples against the
    /// others' rates, as [`Self::batch_ready`] does with no report of theirs yet).
    pub(super) fn share_ready(&self) -> bool {
        let ahead = self.samples + self.last_batch_samples / 2;
        self.next_batch_reaches(ahead, self.cfg.target_batch_size)
    }

    /// While a delayed update's round is in flight: whether the swarm is projected to have
    /// computed [`CollaborativeConfig::delayed_max_stale`] of the next batch (this peer's
    /// samples since the round began, and the others' at the last reading's rates; this
    /// peer's alone with `projected_batch` off), past which the round is waited for.
    pub(super) fn staleness_bound_reached(&self) -> bool {
        let bound = (self.cfg.target_batch_size as f64 * self.cfg.delayed_max_stale).ceil() as u64;
        self.next_batch_reaches(self.samples, bound)
    }

    /// While a delayed update's round is in flight: whether this peer's samples reach `bound`,
    /// or (with `projected_batch`) the swarm's do, projected from `own` of this peer's at the
    /// rates of the last reading.
    fn next_batch_reaches(&self, own: u64, bound: u64) -> bool {
        self.samples >= bound
            || self
                .nothing_reported_yet()
                .filter(|_| self.cfg.projected_batch)
                .is_some_and(|swarm| swarm.projected_with(own, self.compute.rate()) >= bound)
    }
}

impl CollaborativeOptimizer {
    /// Pre-scheduled matchmaking: once the swarm is projected to reach its batch within about
    /// twice the least time matchmaking took (at most half the start grace; plus one batch,
    /// the time until this is checked again), the round's search starts in the background, so
    /// that its group is ready when the gradients are. Not before a round measured how long
    /// matchmaking takes, nor while a delayed update's round is in flight, nor for a peer
    /// alone in the run, nor past the run's last epoch.
    pub(super) fn schedule_matchmaking(&self, swarm: &SwarmProgress) {
        self.schedule_search(swarm, false);
    }

    /// Right after a step whose round held every live peer (`self.swarm` is then the swarm's
    /// progress made up by [`Self::progress_after_round`]): an epoch projected to take at most half
    /// the start grace starts its search now rather than a lead before its end. Every member of
    /// that round is at the same point, so their searches meet at once, and their first round trips
    /// go while no peer computes; started mid-epoch, a search's messages wait for each peer's batch
    /// to end. Two generated-glyphs MLP peers on a core each (6 ms epochs): the group formed
    /// 1.6-2.1 ms after the step, and the run took 1.68-1.71 s against 1.73-1.75 s with the search
    /// started a lead before the epoch's end (six alternating runs each).
    pub(super) fn schedule_after_step(&self) {
        if let Some((_, swarm)) = self.swarm.as_ref() {
            self.schedule_search(swarm, true);
        }
    }

    fn schedule_search(&self, swarm: &SwarmProgress, after_step: bool) {
        let Some(estimate) = self.matchmaking_estimate else {
            return;
        };
        if !self.cfg.scheduled_matchmaking
            || (self.pending.is_some() && !self.pending_searched())
            || (self.samples == 0 && !after_step)
            || self.last_batch_samples == 0
            || swarm.peers <= 1
            || swarm.epoch != self.epoch
            || self.cfg.final_epoch.is_some_and(|last| self.epoch >= last)
            || self.compute.rate().is_nan()
            || self.compute.rate() <= 0.0
        {
            return;
        }
        let ahead = self.samples + self.last_batch_samples / 2;
        let projection = swarm.projected_with(ahead, self.compute.rate());
        let remaining = self.cfg.target_batch_size.saturating_sub(projection);
        let others = (swarm.samples_per_second - swarm.own_samples_per_second).max(0.0);
        let eta = remaining as f64 / (self.compute.rate() + others);
        let batch = self.last_batch_samples as f64 / self.compute.rate();
        // Never earlier than half the start grace: a leader whose search opened that long ago
        // begins with the peers declared by then, without one that prepares later.
        let grace = self.cfg.averager.effective_start_grace().as_secs_f64();
        let lead = if after_step {
            grace / 2.0
        } else {
            (2.0 * estimate.as_secs_f64()).min(grace / 2.0)
        };
        if eta > lead + batch {
            return;
        }
        self.averager.expect_peers(swarm_peers(Some(swarm)));
        self.grace_for_batches();
        self.averager.set_round_tag(self.epoch);
        let deadline = std::time::Instant::now() + self.cfg.averaging_timeout;
        // (A round that carries the state averages the gradients as any other does, and
        // the state after them in the same group: the search is the same.)
        let prepared = match self.compressor.as_ref() {
            Some(Compressor::PowerSgd(state)) => self.averager.prepare_low_rank(state, deadline),
            Some(Compressor::Dct(state)) => self.averager.prepare_sparse(state, deadline),
            None => self.averager.prepare(&[self.len], deadline),
        };
        if prepared {
            tracing::trace!(
                epoch = self.epoch,
                eta_ms = eta * 1e3,
                estimate_ms = estimate.as_secs_f64() * 1e3,
                "matchmaking started ahead of the batch"
            );
        }
    }

    /// Lets the round's leader wait for peers still finishing a batch: the start grace of the
    /// next search is one and a half of this peer's batch times (peers of a run compute alike),
    /// at least the averager's default, at most half the matchmaking window. A grace shorter
    /// than a batch began groups without a peer that was merely computing (4 charlm peers on 2
    /// cores, batches of 0.5-1 s: a third of the rounds in groups of 2 or 3), and each such
    /// peer fell an epoch behind and had to sync. A grace the caller configured stays.
    pub(super) fn grace_for_batches(&self) {
        let cfg = &self.cfg.averager;
        if cfg.start_grace.is_some() || self.last_batch_samples == 0 {
            return;
        }
        let batch = self.last_batch_samples as f64 / self.compute.rate();
        let grace = batch_grace(batch, cfg.effective_start_grace(), cfg.matchmaking_time / 2);
        self.averager.set_start_grace(Some(grace));
    }

    /// Keeps the matchmaking estimate: the time a round that searched only when its step began
    /// took to find its group (a round whose search started ahead says nothing of that).
    pub(super) fn learn_matchmaking(&mut self, report: &StepReport) {
        let Some(round) = report.round.as_ref().filter(|r| !r.prepared) else {
            return;
        };
        // The least time seen: a round's matchmaking time also counts the wait for peers still
        // computing, which starting early cannot save; the peer that arrived last saw only the
        // search.
        let took = round.matchmaking_time;
        self.matchmaking_estimate = Some(self.matchmaking_estimate.map_or(took, |e| e.min(took)));
    }

    /// Publishes this peer's progress after a step (in a task, so that a dropped step does not
    /// cut a publication short); the previous publication, if still in flight, ends first.
    pub(super) async fn publish_in_background(&mut self) -> Result<(), TrainingError> {
        if self.tracker.covered_epoch() == Some(self.epoch)
            && !self.tracker.due(&self.local_progress())
        {
            // The round's members know the new epoch; the report goes out later (see
            // `ProgressTracker::cover`).
            return Ok(());
        }
        if self.publish_took.slow() {
            // A slow network: the next batches start now; the publication ends beside them
            // (collected, or waited for before the next one). A report from between batches
            // still in flight is older than this one: it ends here (the DHT keeps the entry
            // with the latest expiration, so the newer report wins wherever both land).
            self.collect_publication()?;
            if let Some(older) = self.publishing.take() {
                older.abort();
            }
            self.spawn_publication();
            return Ok(());
        }
        self.settle_publication().await?;
        self.spawn_publication();
        // Awaited: on a peer whose compute shares one core with its network tasks, a
        // publication left in flight competes with the next batches and cost more than the
        // wait (MLP pair, 2 x 181 steps: 4.25 / 4.10 s in flight against 3.98 / 3.76 s
        // awaited). It also made a kill/restart test hang about one run in five
        // (training_sync's a_killed_peer_...), never understood.
        self.settle_publication().await
    }

    /// Starts publishing this peer's progress in a task that times it (`publish_took` learns
    /// the time when the task is collected or settled).
    pub(super) fn spawn_publication(&mut self) {
        let (tracker, local) = (self.tracker.clone(), self.local_progress());
        let publish = async move {
            let started = Instant::now();
            (tracker.publish(local).await, started.elapsed())
        };
        self.publishing = Some(tokio::spawn(tracing::Instrument::in_current_span(publish)));
    }

    /// The outcome of a background publication of the progress that has ended, if any (one
    /// still in flight is left to run).
    pub(super) fn collect_publication(&mut self) -> Result<(), TrainingError> {
        let Some(task) = self.publishing.as_mut() else {
            return Ok(());
        };
        let Some(ended) = task.now_or_never() else {
            return Ok(());
        };
        self.publishing = None;
        self.publication_ended(ended)
    }

    /// Waits for a background publication of the progress, if any, so that what this peer
    /// reports next lands after it (its failure counts like any failed report).
    pub(super) async fn settle_publication(&mut self) -> Result<(), TrainingError> {
        let Some(task) = self.publishing.take() else {
            return Ok(());
        };
        let ended = task.await;
        self.publication_ended(ended)
    }

    fn publication_ended(
        &mut self,
        ended: Result<(Result<(), ProgressError>, Duration), tokio::task::JoinError>,
    ) -> Result<(), TrainingError> {
        let published = match ended {
            Ok((r, took)) => {
                self.publish_took.note(took);
                r
            }
            Err(e) => Err(ProgressError::Invalid(format!(
                "the publishing task ended: {e}"
            ))),
        };
        self.tolerate(published).map(|_| ())
    }
}

/// A start grace of one and a half batches of `batch` seconds, within `floor..=ceiling`.
pub(super) fn batch_grace(batch: f64, floor: Duration, ceiling: Duration) -> Duration {
    let wanted = if batch.is_finite() && batch > 0.0 {
        Duration::from_secs_f64((1.5 * batch).min(3600.0))
    } else {
        Duration::ZERO
    };
    wanted.max(floor).min(ceiling)
}
