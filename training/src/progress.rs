//! Progress tracking: every peer publishes how far it is in the current epoch (samples
//! accumulated towards the global batch, its rate) under the run's progress key, in a sub-key
//! signed by its own identity, so nobody can speak for another peer. Every peer reads the key
//! and estimates when the swarm as a whole will reach `target_batch_size`, and whether its own
//! epoch is behind the swarm's.
//!
//! Estimation ([`SwarmProgress::estimate`], pure and unit-tested): the swarm's epoch is the
//! highest epoch any live peer reports; the samples accumulated in it are those reports' sums.
//! The swarm is *ready* only on reported samples (a peer that waits, or averages, stops adding
//! samples, so extrapolating could start a global step before the batch exists); the time left
//! is estimated from the reports extrapolated at each peer's rate. A peer's report expires
//! after `report_lifetime`, so peers that left stop counting.
//!
//! ```no_run
//! # async fn demo(node: starling_node::Node) -> Result<(), starling_training::progress::ProgressError> {
//! use starling_training::progress::{LocalProgress, ProgressConfig, ProgressTracker};
//! let tracker = ProgressTracker::new(node, ProgressConfig::new("my-run", 4096));
//! tracker.report(LocalProgress { epoch: 0, samples: 256, samples_per_second: 900.0 }).await?;
//! let swarm = tracker.fetch().await?;
//! if swarm.ready {
//!     // the swarm has its global batch: average and step
//! }
//! println!("epoch {}: {}/{} samples, ~{:?} to go", swarm.epoch, swarm.samples, 4096, swarm.eta);
//! # Ok(()) }
//! ```

use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use starling_dht::now_ms;
use starling_node::{Node, NodeError, PeerId};
use tokio::time::{timeout, Instant};

/// Why publishing or reading progress failed.
#[derive(Debug, thiserror::Error)]
pub enum ProgressError {
    /// The node failed (`Node(Closed)` when it stopped).
    #[error(transparent)]
    Node(#[from] NodeError),
    /// The DHT did not answer in time.
    #[error("the progress key did not answer within {0:?}")]
    Timeout(Duration),
    /// A local report is impossible (a NaN or negative rate).
    #[error("invalid progress report: {0}")]
    Invalid(String),
}

/// Everything tunable about progress tracking.
///
/// ```
/// use std::time::Duration;
/// use starling_training::progress::ProgressConfig;
/// let mut cfg = ProgressConfig::new("my-run", 4096);
/// cfg.publish_interval = Duration::from_secs(2);
/// assert_eq!(cfg.key(), "my-run.progress");
/// ```
#[derive(Debug, Clone)]
pub struct ProgressConfig {
    /// The training run's name (the progress key is `{run}.progress`).
    pub run: String,
    /// Samples the swarm accumulates per global step.
    pub target_batch_size: u64,
    /// A peer publishes at most this often, except when its epoch changes (bounds DHT traffic:
    /// one small signed write per peer per interval).
    pub publish_interval: Duration,
    /// A report counts for this long after it was written (then the peer is taken as gone).
    pub report_lifetime: Duration,
    /// A report from a peer this node has no open connection to counts only this long after
    /// it was written. A peer that crashed (SIGKILL, power cut) stops publishing and its
    /// connections close; without this it would count for the whole `report_lifetime`, and
    /// every averaging round would wait for it. Peers that are alive but not connected (large
    /// swarms) publish at least every `publish_interval` while they train.
    pub unconnected_lifetime: Duration,
    /// Bound on one DHT read or write.
    pub request_timeout: Duration,
}

impl ProgressConfig {
    /// Defaults: publish at most once a second, reports live 30 s (10 s from peers with no
    /// open connection), 5 s per DHT request.
    pub fn new(run: impl Into<String>, target_batch_size: u64) -> Self {
        ProgressConfig {
            run: run.into(),
            target_batch_size,
            publish_interval: Duration::from_secs(1),
            report_lifetime: Duration::from_secs(30),
            unconnected_lifetime: Duration::from_secs(10),
            request_timeout: Duration::from_secs(5),
        }
    }

    /// The DHT key progress is published under.
    pub fn key(&self) -> String {
        format!("{}.progress", self.run)
    }
}

/// This peer's progress, as the training loop knows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalProgress {
    /// The epoch (number of global steps taken) this peer is in.
    pub epoch: u64,
    /// Samples this peer has accumulated towards the current epoch's batch.
    pub samples: u64,
    /// This peer's recent throughput, samples per second.
    pub samples_per_second: f64,
}

/// One peer's published report (the DHT value under its signed sub-key).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerProgress {
    /// Its epoch.
    pub epoch: u64,
    /// Samples accumulated in that epoch when it reported.
    pub samples: u64,
    /// Its throughput, samples per second.
    pub samples_per_second: f64,
    /// When it reported (unix ms, its clock).
    pub time_ms: u64,
}

/// What the swarm's reports add up to.
#[derive(Debug, Clone, PartialEq)]
pub struct SwarmProgress {
    /// The highest epoch a live peer reports.
    pub epoch: u64,
    /// Samples accumulated in that epoch by all peers in it, as reported.
    pub samples: u64,
    /// The same, extrapolated to now at each peer's rate (what the estimate uses).
    pub projected: u64,
    /// Their summed throughput, samples per second.
    pub samples_per_second: f64,
    /// Peers reporting that epoch.
    pub peers_in_epoch: usize,
    /// Live peers in all.
    pub peers: usize,
    /// Whether the reported `samples` reached the target batch.
    pub ready: bool,
    /// Estimated time until it does (zero when ready; `Duration::MAX` when nobody makes
    /// progress).
    pub eta: Duration,
    /// The part of `samples` that is the reading peer's own report (zero when its report is
    /// missing or of another epoch): a peer that knows its own count exactly puts that in its
    /// place (see [`SwarmProgress::projected_with`]).
    pub own_samples: u64,
    /// The part of `samples_per_second` that is the reading peer's own report.
    pub own_samples_per_second: f64,
}

impl SwarmProgress {
    /// Adds up `reports` (one per live peer) as of `now_ms`, for a global batch of `target`
    /// samples. Reports with a non-finite or negative rate count with rate 0; reports from the
    /// future (clock skew) are not extrapolated.
    ///
    /// ```
    /// use std::time::Duration;
    /// use starling_training::progress::{PeerProgress, SwarmProgress};
    /// let r = |epoch, samples, rate, time_ms| PeerProgress { epoch, samples, samples_per_second: rate, time_ms };
    /// // Two peers in epoch 3 at 100 samples/s each, reported a second ago, and a straggler
    /// // still in epoch 2: 800 samples reported, about 1000 by now.
    /// let s = SwarmProgress::estimate(&[r(3, 300, 100.0, 10_000), r(3, 500, 100.0, 10_000), r(2, 900, 50.0, 10_000)], 1000, 11_000);
    /// assert_eq!((s.epoch, s.samples, s.projected, s.peers_in_epoch, s.peers), (3, 800, 1000, 2, 3));
    /// assert!(!s.ready && s.eta == Duration::ZERO);
    /// ```
    pub fn estimate(reports: &[PeerProgress], target: u64, now_ms: u64) -> SwarmProgress {
        let epoch = reports.iter().map(|r| r.epoch).max().unwrap_or(0);
        let mut samples = 0u64;
        let mut projected = 0f64;
        let mut rate = 0f64;
        let mut peers_in_epoch = 0;
        for r in reports.iter().filter(|r| r.epoch == epoch) {
            let own_rate = if r.samples_per_second.is_finite() && r.samples_per_second > 0.0 {
                r.samples_per_second
            } else {
                0.0
            };
            let age = now_ms.saturating_sub(r.time_ms) as f64 / 1000.0;
            samples = samples.saturating_add(r.samples);
            projected += r.samples as f64 + own_rate * age;
            rate += own_rate;
            peers_in_epoch += 1;
        }
        let projected = (projected.min(u64::MAX as f64) as u64).max(samples);
        let ready = samples >= target && peers_in_epoch > 0;
        let eta = eta(
            ready || peers_in_epoch > 0 && projected >= target,
            target,
            projected,
            rate,
        );
        SwarmProgress {
            epoch,
            samples,
            projected,
            samples_per_second: rate,
            peers_in_epoch,
            peers: reports.len(),
            ready,
            eta,
            own_samples: 0,
            own_samples_per_second: 0.0,
        }
    }

    /// The swarm's samples in this epoch as a peer that holds `own` samples and computes at
    /// `own_rate` samples per second projects them: its own exact count, plus for the others
    /// the larger of what they reported and what they computed in the time this peer took for
    /// its `own` (their rates over `own_rate`, times `own`). Peers that averaged together began
    /// the epoch together, so this needs no fresher report than the one each published after
    /// the step; it is what a peer compares with the target to stop accumulating when the
    /// swarm as a whole has its batch, not when it alone has.
    ///
    /// ```
    /// use starling_training::progress::{PeerProgress, SwarmProgress};
    /// let r = |samples, rate| PeerProgress { epoch: 0, samples, samples_per_second: rate, time_ms: 1_000 };
    /// let mut s = SwarmProgress::estimate(&[r(0, 100.0), r(0, 50.0), r(40, 25.0)], 256, 1_000);
    /// // The last report is this peer's, which has 100 samples by now at 25 samples/s: in
    /// // that time the two others computed (100 + 50) / 25 x 100 samples.
    /// (s.own_samples, s.own_samples_per_second) = (40, 25.0);
    /// assert_eq!(s.projected_with(100, 25.0), 100 + 600);
    /// ```
    pub fn projected_with(&self, own: u64, own_rate: f64) -> u64 {
        let reported = self.samples.saturating_sub(self.own_samples);
        let rate = (self.samples_per_second - self.own_samples_per_second).max(0.0);
        let computed = if own_rate > 0.0 && own_rate.is_finite() {
            (own as f64 * rate / own_rate).min(u64::MAX as f64 / 2.0) as u64
        } else {
            0
        };
        reported.max(computed).saturating_add(own)
    }

    /// This reading completed by what a round that held every live peer says of the epoch it
    /// began: `began` is the swarm as that round left it (every one of its `peers` in this
    /// epoch from `began_ms`, computing at its summed rate; see the collaborative optimizer's
    /// made-up reading). Reports of the epoch land one by one as each peer publishes after the
    /// round (with a delayed update, only when the round ends), so a reading taken meanwhile
    /// holds only the peers that already have, and their rates alone: a peer that stopped at
    /// such a reading's projection computed up to two batches more than its share while the
    /// others waited for it (16 simulated peers, one batch of 32 a half second, target 1024:
    /// readings of 6 of the 16 peers, and 96 or 128 samples from the peer that read them).
    /// The completed reading counts every peer in the epoch at the larger of the two summed
    /// rates, keeps what was reported, and projects at least what the round's peers computed
    /// since `began_ms`. Unchanged when every live peer reported already, when the live peers
    /// are not the round's (one joined or left since), or when `began` is of another epoch.
    ///
    /// ```
    /// use starling_training::progress::{PeerProgress, SwarmProgress};
    /// let r = |samples, rate| PeerProgress { epoch: 7, samples, samples_per_second: rate, time_ms: 10_000 };
    /// // The round held 4 peers at 25 samples/s each and began the epoch at 9 s.
    /// let began = SwarmProgress::estimate(&[r(0, 100.0)], 256, 9_000);
    /// let began = SwarmProgress { peers: 4, peers_in_epoch: 4, epoch: 7, ..began };
    /// // At 10 s one of them has reported: 25 samples at 25 samples/s, and three live peers
    /// // have not reported this epoch yet.
    /// let mut reports = vec![r(25, 25.0)];
    /// reports.extend([6; 3].map(|e| PeerProgress { epoch: e, ..r(900, 25.0) }));
    /// let read = SwarmProgress::estimate(&reports, 256, 10_000);
    /// assert_eq!((read.peers_in_epoch, read.samples_per_second), (1, 25.0));
    /// let full = read.completed_by_round(&began, 9_000, 256, 10_000);
    /// assert_eq!((full.peers_in_epoch, full.samples, full.projected), (4, 25, 100));
    /// assert_eq!(full.samples_per_second, 100.0);
    /// ```
    pub fn completed_by_round(
        &self,
        began: &SwarmProgress,
        began_ms: u64,
        target: u64,
        now_ms: u64,
    ) -> SwarmProgress {
        if self.peers_in_epoch >= self.peers
            || began.epoch != self.epoch
            || began.peers != self.peers
            || began.peers_in_epoch != began.peers
        {
            return self.clone();
        }
        let rate = self.samples_per_second.max(began.samples_per_second);
        let since = now_ms.saturating_sub(began_ms) as f64 / 1000.0;
        let computed = (rate * since).min(u64::MAX as f64 / 2.0) as u64;
        let projected = self.projected.max(computed);
        let eta = eta(self.ready || projected >= target, target, projected, rate);
        SwarmProgress {
            projected,
            samples_per_second: rate,
            peers_in_epoch: self.peers,
            eta,
            own_samples_per_second: if self.own_samples_per_second > 0.0 {
                self.own_samples_per_second
            } else {
                began.own_samples_per_second
            },
            ..self.clone()
        }
    }

    /// Whether a peer in `epoch` is behind the swarm (and should catch up by state sync rather
    /// than step on its own).
    pub fn is_behind(&self, epoch: u64) -> bool {
        epoch < self.epoch
    }
}

/// The time until `projected` samples reach `target` at `rate` samples per second: zero when
/// `reached`, `Duration::MAX` when nothing makes progress.
fn eta(reached: bool, target: u64, projected: u64, rate: f64) -> Duration {
    if reached {
        Duration::ZERO
    } else if rate > 0.0 {
        Duration::try_from_secs_f64(target.saturating_sub(projected) as f64 / rate)
            .unwrap_or(Duration::MAX)
    } else {
        Duration::MAX
    }
}

/// About how often a peer in [`Covered`] epochs publishes its report: it still reaches joiners
/// and observers (who were not in its round) at most about this late.
pub const COVERED_REPORT_INTERVAL: Duration = Duration::from_millis(100);

/// Every how many epochs peers that step every `epoch` publish their [`Covered`] reports: the
/// largest power of two whose epochs last at most [`COVERED_REPORT_INTERVAL`] (1 for epochs that
/// long or longer). The members of a round step together and see about the same epoch length,
/// so they publish in the same epochs, and a reading holds their rates from the same moment: with
/// reports published 100 ms apart each, one glyphs MLP peer read the other's rate 12% low from a
/// slow window and computed 6% more than its share of every batch.
///
/// ```
/// use std::time::Duration;
/// use starling_training::progress::covered_stride;
/// assert_eq!(covered_stride(Duration::from_millis(9)), 8);
/// assert_eq!(covered_stride(Duration::from_millis(40)), 2);
/// assert_eq!(covered_stride(Duration::from_secs(1)), 1);
/// ```
pub fn covered_stride(epoch: Duration) -> u64 {
    let per = COVERED_REPORT_INTERVAL.as_secs_f64() / epoch.as_secs_f64().max(1e-6);
    if per < 2.0 {
        1
    } else {
        // The largest power of two at most `per` (bounded: a report every 1024 epochs at most).
        let p = (per.min(1024.0) as u64).max(1);
        1 << (63 - p.leading_zeros())
    }
}

/// The members of a round that held every live peer of the run, which all stepped together into
/// `epoch` at `since_ms` (unix ms, this peer's clock): each of them knows the others' epoch
/// without reading it. See [`ProgressTracker::cover`].
#[derive(Debug, Clone, PartialEq)]
pub struct Covered {
    /// The epoch the round's members stepped into.
    pub epoch: u64,
    /// The round's members, this peer included.
    pub peers: Vec<PeerId>,
    /// When the round ended.
    pub since_ms: u64,
    /// Reports are due in the epochs that are multiples of this ([`covered_stride`]).
    pub stride: u64,
}

/// Publishes this peer's progress and reads the swarm's (cheap to share by reference).
pub struct ProgressTracker {
    node: Node,
    cfg: ProgressConfig,
    /// The last report published, and when.
    last: Mutex<Option<(Instant, LocalProgress)>>,
    /// Peers whose reports [`Self::fetch`] leaves out ([`Self::set_ignored`]).
    ignored: Mutex<Vec<PeerId>>,
    /// The epoch this peer's last round told it the others are in ([`Self::cover`]).
    covered: Mutex<Option<Covered>>,
}

impl ProgressTracker {
    /// A tracker for `node` in the run `cfg.run`.
    pub fn new(node: Node, cfg: ProgressConfig) -> Self {
        ProgressTracker {
            node,
            cfg,
            last: Mutex::new(None),
            ignored: Mutex::new(Vec::new()),
            covered: Mutex::new(None),
        }
    }

    /// From now on [`Self::fetch`] leaves out these peers' reports (this peer's own always
    /// counts): the peers a verifying averager refuses for lying. Their samples are never
    /// averaged in, so they must not count towards the global batch, nor as live peers a round
    /// waits for (a swarm that counted a refused liar waited out a start grace every round for
    /// it, and stepped on the honest peers' smaller batch).
    ///
    /// ```no_run
    /// # fn demo(tracker: &starling_training::progress::ProgressTracker, liar: starling_node::PeerId) {
    /// tracker.set_ignored(vec![liar]);
    /// # }
    /// ```
    pub fn set_ignored(&self, peers: Vec<PeerId>) {
        *self.ignored.lock().unwrap_or_else(|e| e.into_inner()) = peers;
    }

    /// After a round that held every live peer of the run: its members (`covered.peers`) all
    /// stepped into `covered.epoch` together, so until this peer leaves that epoch or reads a
    /// peer outside the round, (1) its reports of the new epoch are due only in every
    /// `covered.stride`-th epoch (about every [`COVERED_REPORT_INTERVAL`]) instead of at once
    /// (the members know it; a publication after every step was one DHT write per peer and
    /// step, for nobody: two glyphs MLP peers a core each stepped every 9 ms), and (2)
    /// [`Self::fetch`] takes the members' reports written before the round ended, of an
    /// earlier epoch, as reports of `covered.epoch` with no samples at `covered.since_ms` at
    /// their rate. A report written after the round is taken as it is (a member whose part of
    /// the round failed publishes its own epoch). `None` forgets it: reports are due at every
    /// epoch change again.
    ///
    /// ```no_run
    /// # fn demo(tracker: &starling_training::progress::ProgressTracker, me: starling_node::PeerId, other: starling_node::PeerId) {
    /// use starling_training::progress::Covered;
    /// tracker.cover(Some(Covered { epoch: 8, peers: vec![me, other], since_ms: starling_dht::now_ms(), stride: 4 }));
    /// # }
    /// ```
    pub fn cover(&self, covered: Option<Covered>) {
        *self.covered.lock().unwrap_or_else(|e| e.into_inner()) = covered;
    }

    /// The epoch set by [`Self::cover`], if any (a read that met a peer outside the round
    /// forgets it).
    pub fn covered_epoch(&self) -> Option<u64> {
        self.covered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|c| c.epoch)
    }

    /// The configuration in force.
    pub fn config(&self) -> &ProgressConfig {
        &self.cfg
    }

    /// Publishes `local` under this peer's signed sub-key if the last publication is older than
    /// `publish_interval` or named another epoch; otherwise does nothing (rate bound). Returns
    /// whether it published.
    pub async fn report(&self, local: LocalProgress) -> Result<bool, ProgressError> {
        if !(local.samples_per_second.is_finite() && local.samples_per_second >= 0.0) {
            return Err(ProgressError::Invalid(format!(
                "samples_per_second {}",
                local.samples_per_second
            )));
        }
        if !self.due(&local) {
            return Ok(false);
        }
        self.publish(local).await?;
        Ok(true)
    }

    /// Whether [`ProgressTracker::report`] would publish `local`: the last publication (or
    /// the one in flight) is older than `publish_interval` or named another epoch; in an epoch
    /// [`Self::cover`] covers, another epoch only if it is a multiple of the cover's stride.
    pub fn due(&self, local: &LocalProgress) -> bool {
        let stride = self
            .covered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .filter(|c| c.epoch == local.epoch)
            .map(|c| c.stride);
        let last = *self.last.lock().unwrap_or_else(|e| e.into_inner());
        is_due(
            last.map(|(at, prev)| (at.elapsed(), prev.epoch)),
            local.epoch,
            stride,
            self.cfg.publish_interval,
        )
    }

    /// Publishes `local` unless exactly that was the last report: for a peer that has stopped
    /// adding samples this epoch (it waits for the swarm), its final count goes out at once
    /// instead of up to `publish_interval` later. Returns whether it published.
    pub async fn report_final(&self, local: LocalProgress) -> Result<bool, ProgressError> {
        let unchanged = {
            let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            last.is_some_and(|(_, prev)| prev.epoch == local.epoch && prev.samples == local.samples)
        };
        if unchanged {
            return self.report(local).await;
        }
        self.publish(local).await?;
        Ok(true)
    }

    /// Publishes `local` now, whatever the rate bound says (e.g. right after a global step).
    pub async fn publish(&self, local: LocalProgress) -> Result<(), ProgressError> {
        let now = now_ms();
        let value = PeerProgress {
            epoch: local.epoch,
            samples: local.samples,
            samples_per_second: local.samples_per_second,
            time_ms: now,
        };
        let expires = now + self.cfg.report_lifetime.as_millis() as u64;
        let t = self.cfg.request_timeout;
        let subkey = self.node.owner_marker();
        // Counted as published from now on (`report` does not repeat a publication still in
        // flight); a failed one is forgotten, so the next report publishes again.
        let before = self
            .last
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace((Instant::now(), local));
        let stored = match timeout(
            t,
            self.node.store(&self.cfg.key(), &subkey, &value, expires),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            // Stored here but no other peer acknowledged it: a run's first peer, or one whose
            // neighbours just left. Its own store answers the others' reads; not an error.
            Ok(Err(NodeError::QuorumFailed { .. })) => {
                tracing::debug!("progress stored locally only (no peer acknowledged it yet)");
                Ok(())
            }
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(ProgressError::Timeout(t)),
        };
        if stored.is_err() {
            let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            if last.as_ref().is_some_and(|(_, l)| *l == local) {
                *last = before;
            }
        }
        stored
    }

    /// Every live peer's genuine report: only entries whose sub-key is the owner marker of the
    /// peer it is read as (the DHT holds such entries only with that owner's signature).
    pub async fn reports(&self) -> Result<Vec<(PeerId, PeerProgress)>, ProgressError> {
        let key = self.cfg.key();
        let t = self.cfg.request_timeout;
        let entries = timeout(t, self.node.get::<PeerProgress>(&key))
            .await
            .map_err(|_| ProgressError::Timeout(t))??;
        Ok(entries
            .into_iter()
            .filter_map(|(subkey, report, _)| {
                let owner = starling_dht::required_owner(&key, &subkey).ok()??;
                Some((starling_node::peer_id_of_owner(&owner)?, report))
            })
            .collect())
    }

    /// Reads every live report and adds them up (see [`SwarmProgress::estimate`]). A report
    /// counts while it is younger than `report_lifetime` if its peer is connected to this node
    /// (or is this node), and younger than `unconnected_lifetime` otherwise.
    pub async fn fetch(&self) -> Result<SwarmProgress, ProgressError> {
        let reports = self.reports().await?;
        let t = self.cfg.request_timeout;
        let connected = timeout(t, self.node.connected_peers())
            .await
            .map_err(|_| ProgressError::Timeout(t))??;
        let now = now_ms();
        let me = self.node.peer_id();
        // Refused liars, and peers found down (a crashed peer's last report would otherwise
        // count for `unconnected_lifetime`, and rounds would wait for it).
        let mut ignored = self
            .ignored
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        ignored.extend(self.node.peers_down());
        let mut reports = live_reports(
            reports,
            me,
            &connected,
            &ignored,
            self.cfg.unconnected_lifetime,
            now,
        );
        {
            let mut covered = self.covered.lock().unwrap_or_else(|e| e.into_inner());
            if !lift_covered(&mut reports, covered.as_ref()) {
                // A peer outside the round (a joiner): it needs every member's own reports.
                *covered = None;
            }
        }
        let own = reports
            .iter()
            .find(|(p, _)| *p == me)
            .map(|(_, r)| r.clone());
        let reports: Vec<PeerProgress> = reports.into_iter().map(|(_, r)| r).collect();
        let mut swarm = SwarmProgress::estimate(&reports, self.cfg.target_batch_size, now);
        if let Some(own) = own.filter(|r| r.epoch == swarm.epoch) {
            let alone = SwarmProgress::estimate(&[own], 0, now);
            swarm.own_samples = alone.samples;
            swarm.own_samples_per_second = alone.samples_per_second;
        }
        Ok(swarm)
    }
}

/// The reports that count: this peer's own and connected peers' (the DHT already dropped
/// those past `report_lifetime`), and others' younger than `unconnected_lifetime` at `now_ms`;
/// never those of `ignored` peers (refused for lying) but this peer's own.
fn live_reports(
    reports: Vec<(PeerId, PeerProgress)>,
    me: PeerId,
    connected: &[PeerId],
    ignored: &[PeerId],
    unconnected_lifetime: Duration,
    now_ms: u64,
) -> Vec<(PeerId, PeerProgress)> {
    let max_age = unconnected_lifetime.as_millis() as u64;
    reports
        .into_iter()
        .filter(|(peer, r)| {
            *peer == me
                || (!ignored.contains(peer)
                    && (connected.contains(peer) || now_ms.saturating_sub(r.time_ms) <= max_age))
        })
        .collect()
}

/// Whether a report of `epoch` is due when the last one (`last`: its age and epoch) was
/// published; `stride`: the [`Covered`] stride when the epoch is covered (see
/// [`ProgressTracker::due`]).
fn is_due(
    last: Option<(Duration, u64)>,
    epoch: u64,
    stride: Option<u64>,
    interval: Duration,
) -> bool {
    last.is_none_or(|(age, prev)| {
        (prev != epoch && stride.is_none_or(|k| epoch.is_multiple_of(k.max(1)))) || age >= interval
    })
}

/// Takes the reports of `covered`'s members written before its round ended, of an earlier
/// epoch, as reports of its epoch with no samples when the round ended (see
/// [`ProgressTracker::cover`]). Returns false, changing nothing, if a report comes from a peer
/// outside the round (or `covered` is `None`).
fn lift_covered(reports: &mut [(PeerId, PeerProgress)], covered: Option<&Covered>) -> bool {
    let Some(c) = covered else {
        return false;
    };
    if reports.iter().any(|(p, _)| !c.peers.contains(p)) {
        return false;
    }
    for (_, r) in reports.iter_mut() {
        if r.epoch < c.epoch && r.time_ms < c.since_ms {
            *r = PeerProgress {
                epoch: c.epoch,
                samples: 0,
                samples_per_second: r.samples_per_second,
                time_ms: c.since_ms,
            };
        }
    }
    true
}

#[cfg(test)]
mod tests;
