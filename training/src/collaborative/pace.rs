//! How this peer keeps pace with the swarm: its own sample counts and compute rate, the
//! progress it publishes, the swarm's progress it reads (falling back to the last reading when
//! a read fails), and taking the swarm's epoch when one behind.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tracing::Instrument;

use starling_node::NodeError;

use super::{CollaborativeOptimizer, StepReport, TrainingError, RATE_WINDOW};

/// Times a freshly synced state is found an epoch old (each time the caller syncs again)
/// before the peer takes the swarm's epoch anyway (see `take_swarm_epoch`).
const STALE_SYNC_RETRIES: u32 = 3;

/// Batch intervals after which the compute rate is measured afresh (or a quarter second).
const COMPUTE_WINDOW_BATCHES: u32 = 8;

/// This peer's compute rate: samples per second of the caller's time between `step` calls,
/// measured over windows of a quarter second or of [`COMPUTE_WINDOW_BATCHES`] intervals,
/// whichever fills first, each full window blended half and half with the rate before it.
///
/// Every batch counts, the first after a step included (its interval starts when the
/// stepping call returned; not with `projected_batch` off, whose callers may not compute
/// between a step and their next batch): a peer that computes only one batch an epoch would
/// otherwise never measure again, and one slow window (a neighbour's state sync, an
/// evaluation) would stay its rate for good. That happened: two charlm peers, 4 batches a
/// global step, one peer's rate stuck at a third of the other's for 18 epochs; it stopped after
/// one batch, the other computed three, and every such step took half as long again.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct ComputeMeter {
    rate: f64,
    secs: f64,
    samples: u64,
    intervals: u32,
}

impl ComputeMeter {
    /// Samples per second, 0 before the first measured batch.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// One batch of `samples` that took `secs` of the caller's time.
    pub fn note(&mut self, secs: f64, samples: u64) {
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        self.secs += secs;
        self.samples += samples;
        self.intervals += 1;
        let full = self.secs >= RATE_WINDOW.as_secs_f64() / 8.0
            || self.intervals >= COMPUTE_WINDOW_BATCHES;
        let current = self.samples as f64 / self.secs.max(1e-6);
        if self.rate == 0.0 {
            // The first measurement stands in until a window is full.
            self.rate = current;
        } else if full {
            self.rate = 0.5 * (self.rate + current);
        }
        if full {
            (self.secs, self.samples, self.intervals) = (0.0, 0, 0);
        }
    }
}

/// A publication or read of the progress that takes this long marks the network slow (a
/// DHT operation is a few round trips: on loopback or a LAN it takes a few milliseconds, over
/// 50 ms of round-trip time several hundred). Then those made between batches run in the
/// background: awaited, they held a 4-peer swarm with 50 ms round trips at 0.53 of the ideal
/// rate, 0.5 s of every 1 s step spent waiting on them. At a step (where the peers must agree
/// on the epoch) reads stay awaited. 40 ms: at 20, 16 simulated peers sharing 2 cores on
/// loopback crossed it and read in the background, and their staler readings let the global
/// batch overshoot (1197-1226 mean for 1024, against 1040-1043 at 40 ms); at 60, a write to
/// peers 50 ms away (one round trip once its closest peers are known) stayed under it.
pub(super) const SLOW_PROGRESS: Duration = Duration::from_millis(40);

/// How long the last few progress operations of one kind took. The network counts as slow
/// only when every one of the last [`Latency::KEPT`] took [`SLOW_PROGRESS`] or more: a peer
/// whose core is busy computing sees single slow operations on loopback too, and spawned ones
/// then compete with its batches (the MLP pair on one core each ran slower with them).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Latency {
    last: [Duration; Latency::KEPT],
    next: usize,
}

impl Latency {
    const KEPT: usize = 4;

    pub(super) fn note(&mut self, took: Duration) {
        self.last[self.next] = took;
        self.next = (self.next + 1) % Self::KEPT;
    }

    pub(super) fn slow(&self) -> bool {
        self.last.iter().all(|t| *t >= SLOW_PROGRESS)
    }
}

/// Whether a reading holds other peers in its epoch whose rates are all still unmeasured (0: a
/// joiner before its first batches, or peers that stopped adding samples). Projected at no rate,
/// they compute nothing: a peer going by such a reading computes the whole global batch itself
/// while they wait. It happened for a joiner's first eight epochs (two glyphs MLP peers: global
/// batches of 3200 for a target of 2048, the joiner waiting 6-11 ms a step), the made-up
/// readings after each round carrying the zero rate until the next read half a second later.
/// Such a reading is read again soon, and no reading is made up from it.
pub(super) fn unmeasured_others(s: &SwarmProgress) -> bool {
    s.peers_in_epoch > 1 && s.samples_per_second - s.own_samples_per_second <= 0.0
}

/// A background read of the swarm's progress: its result and how long it took.
pub(super) type Fetching =
    tokio::task::JoinHandle<(Result<SwarmProgress, ProgressError>, Duration)>;
use crate::progress::{LocalProgress, ProgressError, ProgressTracker, SwarmProgress};

impl CollaborativeOptimizer {
    /// Moves the failures met during this call into its report.
    pub(super) fn with_errors(
        &mut self,
        report: Result<StepReport, TrainingError>,
    ) -> Result<StepReport, TrainingError> {
        let errors = std::mem::take(&mut self.errors);
        report.map(|mut r| {
            r.errors.extend(errors);
            r
        })
    }

    /// A progress read or write that failed without this peer's node being gone is noted
    /// (the report's `errors`, a log line) and training goes on; the node stopping ends it.
    pub(super) fn tolerate<T>(
        &mut self,
        r: Result<T, ProgressError>,
    ) -> Result<Option<T>, TrainingError> {
        match r {
            Ok(v) => Ok(Some(v)),
            Err(ProgressError::Node(NodeError::Closed)) => {
                Err(ProgressError::Node(NodeError::Closed).into())
            }
            Err(e) => {
                tracing::warn!("progress: {e}; going on with the last reading");
                self.errors.push(format!("progress: {e}"));
                Ok(None)
            }
        }
    }

    /// Updates the sample count and both rates: the wall-clock rate, samples over wall time in
    /// windows of [`RATE_WINDOW`], pauses for averaging included (smoothing per-batch rates
    /// instead over-weights the fast batches and overstates the throughput several times
    /// over); and the compute rate that [`CollaborativeOptimizer::local_progress`] publishes.
    pub(super) fn note_batch(&mut self, batch_samples: u64) {
        self.samples += batch_samples;
        self.last_batch_samples = batch_samples;
        let now = Instant::now();
        // The compute rate: only the caller's time between a `step` call's return and the
        // next batch (time inside `step` is not computing), unless the epoch changed in between
        // otherwise than by that call (a state sync, a `try_step` that stepped; see `step` for
        // `projected_batch` off).
        if let Some((prev, epoch)) = self.last_batch {
            if epoch == self.epoch {
                self.compute
                    .note(now.duration_since(prev).as_secs_f64(), batch_samples);
            }
        }
        self.epoch_start.get_or_insert(now);
        let Some((start, samples)) = self.rate_window.as_mut() else {
            // The first batch's time is unknown: the window starts at its end.
            self.rate_window = Some((now, 0));
            return;
        };
        *samples += batch_samples;
        let elapsed = now.duration_since(*start).as_secs_f64();
        if elapsed >= RATE_WINDOW.as_secs_f64() / 20.0 {
            let current = *samples as f64 / elapsed.max(1e-6);
            self.rate = if elapsed >= RATE_WINDOW.as_secs_f64() || self.rate == 0.0 {
                current
            } else {
                // Early in a window: blend with the last full window's rate.
                0.5 * (self.rate + current)
            };
        }
        if elapsed >= RATE_WINDOW.as_secs_f64() {
            self.rate_window = Some((now, 0));
        }
    }

    /// This peer's progress as others read it. The rate is the compute rate once measured
    /// (samples per second while computing batches): what the others extrapolate this peer's
    /// samples with between its reports. The wall-clock rate (waits included) undercounts
    /// several times over when averaging takes longer than computing, and every peer then
    /// computed most of the global batch itself.
    pub(super) fn local_progress(&self) -> LocalProgress {
        LocalProgress {
            epoch: self.epoch,
            samples: self.samples,
            samples_per_second: if self.compute.rate() > 0.0 {
                self.compute.rate()
            } else {
                self.rate
            },
        }
    }

    /// This peer's progress with its count final for the epoch: a rate of 0, so that nobody
    /// projects samples it will not compute (a peer waiting for the swarm, or for a joiner).
    pub(super) fn final_progress(&self) -> LocalProgress {
        LocalProgress {
            samples_per_second: 0.0,
            ..self.local_progress()
        }
    }

    /// The progress tracker, told first which peers the averager refuses for lying (they count
    /// neither as peers nor towards the batch), and to forget a covered epoch this peer is no
    /// longer in: every read of the swarm's progress goes through it.
    pub(super) fn reading_tracker(&self) -> Arc<ProgressTracker> {
        self.tracker.set_ignored(self.averager.refused_peers());
        if self
            .tracker
            .covered_epoch()
            .is_some_and(|e| e != self.epoch)
        {
            // This peer left the epoch its last round covered otherwise than by a round (a
            // sync, a failed round): the others' reports are read as they are.
            self.tracker.cover(None);
        }
        self.tracker.clone()
    }

    /// The swarm's progress: read from the DHT at most every `fetch_interval`, extrapolated in
    /// between with this peer's own new samples. A read that fails (a DHT neighbour that died
    /// and has not been noticed yet) falls back to the last reading, with this peer's own
    /// progress in place of its report there; before any reading, to this peer alone.
    pub(super) async fn swarm_progress(&mut self) -> Result<SwarmProgress, TrainingError> {
        if let Some((at, s)) = self.swarm.clone() {
            // A reading in which some live peers have not reported this epoch yet (they step
            // about when this peer does, and publish right after) is read again sooner: their
            // samples and rates are what tells this peer to stop accumulating.
            let fresh_for = if s.peers_in_epoch < s.peers || unmeasured_others(&s) {
                self.cfg.fetch_interval / 10
            } else {
                self.cfg.fetch_interval
            };
            if at.elapsed() < fresh_for && s.epoch == self.epoch {
                return Ok(s.clone());
            }
            if s.epoch == self.epoch && self.fetch_took.slow() {
                // A slow network: the reading of this epoch serves while a fresh one is read
                // in the background.
                if let Some(fresh) = self.collect_fetch()? {
                    return Ok(fresh);
                }
                if self.fetching.is_none() {
                    let tracker = self.reading_tracker();
                    let fetch = async move {
                        let started = Instant::now();
                        let r = tracker.fetch().await;
                        (r, started.elapsed())
                    };
                    let task = tokio::spawn(fetch.in_current_span());
                    self.fetching = Some((self.epoch, task));
                }
                return Ok(s);
            }
        }
        if let Some((_, task)) = self.fetching.take() {
            task.abort();
        }
        let started = Instant::now();
        let fetched = self.reading_tracker().fetch().await;
        self.fetch_took.note(started.elapsed());
        let s = match self.tolerate(fetched)? {
            Some(s) => {
                let s = self.completed(s);
                self.last_read = Some(s.clone());
                self.last_read_at = Some(Instant::now());
                s
            }
            None => self.fallback_progress(),
        };
        self.swarm = Some((Instant::now(), s.clone()));
        Ok(s)
    }

    /// The reading of a background read that has ended, if it was started in this epoch (it
    /// becomes the swarm's reading); one of an earlier epoch is dropped.
    fn collect_fetch(&mut self) -> Result<Option<SwarmProgress>, TrainingError> {
        let Some((epoch, task)) = self.fetching.as_mut() else {
            return Ok(None);
        };
        let epoch = *epoch;
        let Some(ended) = task.now_or_never() else {
            return Ok(None);
        };
        self.fetching = None;
        let Ok((fetched, took)) = ended else {
            return Ok(None); // aborted
        };
        self.fetch_took.note(took);
        let Some(s) = self.tolerate(fetched)? else {
            return Ok(None);
        };
        // Completed before the epoch check: a read begun in an earlier epoch still hands on its
        // rates (below), and a partial reading's are only those of the peers that reported.
        let s = self.completed(s);
        if epoch != self.epoch {
            // Its samples are an earlier epoch's, but its rates are the latest known: where
            // epochs end faster than a read (a slow network), no read ends in the epoch it
            // began in, and without these the swarm's rates would stay those of the first
            // reading (zero, before anyone had measured its compute) for the whole run.
            if let Some(last) = self.last_read.as_mut().filter(|l| l.peers == s.peers) {
                last.samples_per_second = s.samples_per_second;
                last.own_samples_per_second = s.own_samples_per_second;
            }
            return Ok(None);
        }
        self.last_read = Some(s.clone());
        self.last_read_at = Some(Instant::now());
        self.swarm = Some((Instant::now(), s.clone()));
        Ok(Some(s))
    }

    /// A reading of this epoch completed by the round that began it, if that round held every
    /// live peer ([`SwarmProgress::completed_by_round`]): the peers that have not published
    /// the epoch yet are in it all the same.
    fn completed(&self, s: SwarmProgress) -> SwarmProgress {
        match &self.round_began {
            Some((began_ms, began)) => s.completed_by_round(
                began,
                *began_ms,
                self.cfg.target_batch_size,
                starling_dht::now_ms(),
            ),
            None => s,
        }
    }

    /// What the swarm's progress is taken to be when it cannot be read: the last reading if
    /// it is of this epoch or later, else this peer alone in its epoch with the last
    /// reading's peer count.
    pub(super) fn fallback_progress(&self) -> SwarmProgress {
        let mut own = SwarmProgress::estimate(
            &[crate::progress::PeerProgress {
                epoch: self.epoch,
                samples: self.samples,
                samples_per_second: self.local_progress().samples_per_second,
                time_ms: starling_dht::now_ms(),
            }],
            self.cfg.target_batch_size,
            starling_dht::now_ms(),
        );
        own.own_samples = own.samples;
        own.own_samples_per_second = own.samples_per_second;
        match &self.last_read {
            Some(last) if last.epoch >= self.epoch => last.clone(),
            Some(last) => SwarmProgress {
                peers: last.peers.max(1),
                ..own
            },
            None => own,
        }
    }

    /// One epoch behind the swarm: a joiner that synced just before the others stepped, or a
    /// peer whose last round failed while the others' succeeded. It averages with them either
    /// way (rounds are not keyed by epoch); taking their epoch number (and the optimizer's step
    /// count, for AdamW's bias correction) keeps both sides agreeing on which rounds carry the
    /// state, and that round brings its parameters back to the swarm's. Further behind, the
    /// caller syncs state.
    ///
    /// Not right after a state sync: the synced state is then simply an epoch old (the donor
    /// stepped while this peer downloaded it), and taking the epoch would average the swarm's
    /// gradients into older parameters; the step reports `behind` so that the caller syncs
    /// again, up to [`STALE_SYNC_RETRIES`] times (then it takes the epoch, as a caller that does
    /// not sync would leave it waiting for ever).
    pub(super) fn take_swarm_epoch(&mut self, swarm: &SwarmProgress) {
        if swarm.epoch != self.epoch + 1 || swarm.peers_in_epoch == 0 {
            return;
        }
        if self.stale_sync() {
            return;
        }
        self.adopt_epoch(swarm.epoch);
    }

    /// Whether this peer's state was synced since its last step and the swarm is found an
    /// epoch ahead of it: counted, and true (sync again) up to [`STALE_SYNC_RETRIES`] times;
    /// then the peer takes the swarm's epoch after all.
    pub(super) fn stale_sync(&mut self) -> bool {
        let Some(waits) = self.fresh_sync.as_mut() else {
            return false;
        };
        if *waits >= STALE_SYNC_RETRIES {
            self.fresh_sync = None;
            return false;
        }
        *waits += 1;
        tracing::debug!(
            epoch = self.epoch,
            "the synced state is an epoch old: sync again"
        );
        true
    }

    /// A round met the others' round of epoch `theirs`: the step was not taken, and the caller
    /// is told to sync (`behind`) to at least that epoch (the others' state now: a peer that
    /// syncs it in time joins the round they are forming; one that waited for the epoch after
    /// would deadlock a pair, whose other peer waits for it to end that round); until it does,
    /// the next round takes that epoch (`catch_up`).
    pub(super) fn note_behind(&mut self, report: &mut StepReport, theirs: u64) {
        tracing::debug!(
            epoch = self.epoch,
            theirs,
            "a round found the others in a later epoch: not stepping"
        );
        self.behind_of = Some(theirs);
        self.swarm = None;
        report.behind = true;
        report.others_epoch = Some(theirs);
        report.stepped = false;
        report.epoch = self.epoch;
    }

    /// After this peer's round of `epoch` formed no group (or failed before it could say
    /// with whom): the swarm's epoch, read afresh, if a live peer has already stepped past
    /// `epoch`. The others then took this step without this peer (their round went on without
    /// it), and stepping alone would leave this peer's parameters apart from theirs until the
    /// next state round, or for good in a run that ends first (a late joiner missed by its
    /// first round ended a short run with its own model): the caller is told to sync instead
    /// (`behind`). When nobody has stepped yet (every member's round failed alike), `None`:
    /// this peer steps alone as before, and one that reads the progress after it will sync
    /// from it. A round that formed but averaged only part of the values is not asked about:
    /// its members hold the same partial result and step alike (the first to step would
    /// otherwise send the others to sync).
    pub(super) async fn others_moved_on(
        &mut self,
        epoch: u64,
    ) -> Result<Option<u64>, TrainingError> {
        self.swarm = None;
        let swarm = self.swarm_progress().await?;
        let moved_on = swarm.epoch > epoch && swarm.peers_in_epoch > 0;
        if moved_on {
            tracing::debug!(
                epoch,
                theirs = swarm.epoch,
                "this peer's round failed and the others stepped: syncing, not stepping alone"
            );
        }
        Ok(moved_on.then_some(swarm.epoch))
    }

    /// Before a round: a peer that a round found behind and that did not sync since takes the
    /// others' epoch (it trains on from its own values, apart from theirs until the next
    /// state round), so that it can group with them again.
    pub(super) fn catch_up(&mut self) {
        let Some(theirs) = self.behind_of.take() else {
            return;
        };
        if self.outer.is_some() {
            // Local SGD: the epoch counts outer steps; the inner optimizer's steps are its own.
            if theirs > self.epoch {
                self.epoch = theirs;
                self.metrics.epoch.set(self.epoch as i64);
            }
        } else {
            self.adopt_epoch(theirs);
        }
    }

    /// Takes the swarm's epoch `to` (and the optimizer's step count with it, for AdamW's bias
    /// correction).
    pub(super) fn adopt_epoch(&mut self, to: u64) {
        if to <= self.epoch {
            return;
        }
        tracing::debug!(from = self.epoch, to, "behind the swarm: taking its epoch");
        let steps = self.optimizer.steps() + (to - self.epoch);
        self.optimizer.set_steps(steps);
        self.epoch = to;
        self.metrics.epoch.set(self.epoch as i64);
    }
}

impl CollaborativeOptimizer {
    /// The swarm's progress right after a step whose round (`report`'s) averaged with every
    /// live peer of the last reading: all of them are in the new epoch with no samples at
    /// `since_ms` (when the epoch began: the step, or a delayed round's launch), computing at
    /// the rates they reported. Exactly what a read would return once their post-step reports
    /// land, known without one, so the next epoch starts computing at once instead of waiting
    /// out a DHT read (about a millisecond on loopback, several round trips between hosts).
    /// Dated as the last actual read, so the next read is due `fetch_interval` after it (a
    /// peer that joined meanwhile is seen then; made-up readings in a row must not put the
    /// next read off for good, or a swarm stepping faster than `fetch_interval` never sees a
    /// joiner, which then misses every round until the next state round reads the progress
    /// again). `None` (read as usual) after a round that missed a live peer, or with no
    /// reading to go on.
    pub(super) fn progress_after_round(
        &self,
        report: &StepReport,
        since_ms: u64,
    ) -> Option<(Instant, SwarmProgress)> {
        let group = report
            .round
            .as_ref()
            .filter(|r| report.averaging_error.is_none() && r.failed_peers.is_empty())
            .map_or(0, |r| r.group.len());
        let last = self.last_read.as_ref()?;
        if group < 2
            || group != last.peers
            || last.peers_in_epoch != last.peers
            || unmeasured_others(last)
        {
            return None;
        }
        // The whole swarm as one report of no samples at the summed rate, now: `estimate`'s
        // readiness and time to the target; then the peers it stands for.
        let now = starling_dht::now_ms();
        let swarm = SwarmProgress::estimate(
            &[crate::progress::PeerProgress {
                epoch: self.epoch,
                samples: 0,
                samples_per_second: last.samples_per_second,
                time_ms: since_ms.min(now),
            }],
            self.cfg.target_batch_size,
            now,
        );
        let read_at = self.last_read_at.unwrap_or_else(Instant::now);
        Some((
            read_at,
            SwarmProgress {
                peers_in_epoch: group,
                peers: group,
                own_samples_per_second: last.own_samples_per_second,
                ..swarm
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_network_is_slow_only_after_every_kept_operation_was() {
        let mut l = Latency::default();
        assert!(!l.slow(), "nothing measured yet");
        for _ in 0..Latency::KEPT - 1 {
            l.note(Duration::from_millis(150));
            assert!(!l.slow());
        }
        l.note(Duration::from_millis(150));
        assert!(l.slow());
        // One fast operation (a loopback spike is the reverse case) ends it.
        l.note(Duration::from_millis(2));
        assert!(!l.slow());
    }

    #[test]
    fn a_reading_whose_other_peers_have_no_rate_yet_is_unmeasured() {
        use crate::progress::PeerProgress;
        let r = |samples, rate| PeerProgress {
            epoch: 4,
            samples,
            samples_per_second: rate,
            time_ms: 1_000,
        };
        let with_own = |reports: &[PeerProgress], own: f64| {
            let mut s = SwarmProgress::estimate(reports, 2048, 1_000);
            s.own_samples_per_second = own;
            s
        };
        // A joiner that has not measured its compute yet: this peer would compute everything.
        assert!(unmeasured_others(&with_own(&[r(0, 9e4), r(32, 0.0)], 9e4)));
        // Measured, or alone in the epoch: nothing to read again for.
        assert!(!unmeasured_others(&with_own(&[r(0, 9e4), r(32, 8e4)], 9e4)));
        assert!(!unmeasured_others(&with_own(&[r(0, 9e4)], 9e4)));
        // One of two others measured: the estimate holds part of the others' rate.
        assert!(!unmeasured_others(&with_own(
            &[r(0, 9e4), r(32, 0.0), r(64, 7e4)],
            9e4
        )));
    }

    #[test]
    fn one_slow_window_does_not_stick_when_a_peer_computes_one_batch_an_epoch() {
        // 32 samples a batch in 0.325 s (about 98 samples/s), one batch an epoch: every
        // interval fills a window (a quarter second).
        let mut m = ComputeMeter::default();
        assert_eq!(m.rate(), 0.0);
        m.note(0.325, 32);
        assert!((m.rate() - 32.0 / 0.325).abs() < 1e-9);
        // A neighbour's state sync slows one batch to 0.9 s.
        m.note(0.9, 32);
        let slow = m.rate();
        assert!(slow < 32.0 / 0.325 * 0.75, "{slow}");
        // The next batches bring it back within 5%.
        for _ in 0..6 {
            m.note(0.325, 32);
        }
        assert!(
            (m.rate() / (32.0 / 0.325) - 1.0).abs() < 0.05,
            "{}",
            m.rate()
        );
    }

    #[test]
    fn fast_batches_are_measured_over_several_intervals() {
        let mut m = ComputeMeter::default();
        // 1 ms batches of 32: the first stands in, then windows of 8 intervals.
        m.note(0.001, 32);
        assert!((m.rate() - 32_000.0).abs() < 1e-6);
        for _ in 0..6 {
            m.note(0.002, 32);
        }
        // Not full yet (7 intervals, the first included): the first measurement stands.
        assert!((m.rate() - 32_000.0).abs() < 1e-6);
        m.note(0.002, 32);
        // Full (8 x 32 samples in 15 ms): blended half and half with the rate before.
        let window = 8.0 * 32.0 / 0.015;
        assert!(
            (m.rate() - 0.5 * (32_000.0 + window)).abs() < 1e-6,
            "{}",
            m.rate()
        );
        // Bad input changes nothing.
        let before = m.clone();
        m.note(f64::NAN, 32);
        m.note(-1.0, 32);
        assert_eq!(m, before);
    }
}
