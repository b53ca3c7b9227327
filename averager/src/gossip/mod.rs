//! Gossip averaging: each peer averages with a few neighbours whenever it is ready, instead of
//! the whole group at once, so peers of very different speeds never wait for each other
//! (decentralized SGD, as in Bluefog's neighbour averaging).
//!
//! - [`GossipAverager`]: the handle. [`GossipAverager::step`] runs one round on the caller's
//!   tensors (or [`GossipAverager::step_blocking`] from a plain thread);
//!   [`GossipAverager::start_background`] gossips continuously on a [`GossipBuffer`] shared
//!   with a training loop until its [`GossipHandle`] stops or drops.
//! - [`GossipConfig`] and [`Topology`]: ring, exponential graph, random-k, one-peer dynamic
//!   exponential, over the live members.
//! - [`GossipReport`] / [`Exchange`]: who was averaged with, with which weights, how many bytes,
//!   and what happened to every exchange.
//! - [`weighted_mean`], [`consensus_distance`]: the measures tests and benchmarks use.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::{Duration, Instant};
//! use starling_averager::gossip::{GossipAverager, GossipConfig, Topology};
//! use starling_node::{Node, NodeConfig};
//!
//! let node = Node::start(NodeConfig::default()).await?;
//! let cfg = GossipConfig::new("my-run").topology(Topology::OnePeerExponential);
//! let gossip = GossipAverager::new(node, cfg).await?;
//! let mut params = vec![0.0f32; 1000];
//! for _ in 0..100 {
//!     // ... a local optimizer step on `params` ...
//!     let report = gossip.step(&mut [&mut params[..]], 1.0, Instant::now() + Duration::from_secs(10)).await?;
//!     println!("averaged with {:?}", report.averaged_with());
//! }
//! gossip.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! # Membership and topology
//!
//! A peer that gossips declares itself under `{prefix}.gossip` in the DHT, in a sub-key under
//! its own owner marker (signed, so nobody else can write or remove it), with the membership
//! TTL as expiration, renewed every third of it while it gossips. Readers keep only
//! declarations written by the peer they name and with their own schema (element count and
//! codec). The live view is those peers minus the ones being skipped after a failure, sorted by
//! peer id: a peer's position is its rank, and the topology maps ranks to neighbours. The view
//! is re-read every `membership_refresh`, and a failed neighbour leaves it at once (for its
//! back-off), so the graph closes over dead peers long before their declarations expire.
//!
//! # The exchange: pairwise exclusive push-pull
//!
//! Two schemes keep the global weighted mean unchanged: push-sum (each peer halves a
//! (value x weight, weight) pair and pushes one half; estimates are value / weight) and
//! pairwise push-pull. We use **pairwise exclusive push-pull**:
//!
//! - The initiator sends its values; the responder sends back the *difference*
//!   `d = x_b - x̂_a` and decodes its own encoding into `d̂`, which is bit for bit what the
//!   initiator decodes. The initiator adds `c_a d̂`, the responder subtracts `c_b d̂`, with
//!   `w_a c_a = w_b c_b` ([`mix`](self) docs), so the pair's weighted mass is preserved
//!   **whatever the codec**, up to float rounding: a quantizing codec slows consensus (the
//!   difference is off by the codec's error) but cannot bias the mean. With `alpha = 1` and the
//!   exact codec both end on the pair's weighted mean.
//! - Each peer holds an exclusive lock for the whole exchange, so it is in at most one at a
//!   time: two overlapping exchanges cannot both move it by stale differences (the overshoot
//!   that makes unlocked pairwise averaging diverge). A responder that is busy answers `Busy`
//!   at once and the initiator retries after a random pause (for up to `busy_patience`); nobody
//!   waits for a lock while holding another, so there is no deadlock.
//! - Updates are *added* to whatever the vector holds when they are applied, so a training
//!   loop's own steps in between (background mode) are kept, and exchanges commute.
//! - Why not push-sum: its messages carry mass one way, so every message lost to a dead or slow
//!   peer loses mass for good, and the values a peer trains on are `value / weight`, whose
//!   weight can drift to tiny numbers under uneven speeds. Push-pull keeps every peer's own
//!   values as its estimate (what an optimizer needs), and an exchange either completes on both
//!   sides or on neither, except in one window: the initiator applies, then sends `Applied`; a
//!   responder that never gets it keeps its values ([`ExchangeOutcome::Unconfirmed`], logged),
//!   which moves the pair's mass by one update. That needs the stream to break in the last
//!   message of an exchange; a peer that dies takes its own mass with it anyway.
//!
//! # Rounds, steps and the background loop
//!
//! A round is: refresh the view if due, ask the topology for this round's targets, and
//! exchange with each in turn (busy ones retried for `busy_patience`, failed ones backed off).
//! Every wait is bounded by the round's deadline. A peer keeps *answering* exchanges between
//! its own rounds, so a slow peer never holds up fast ones: they exchange with it whenever
//! they reach it, whatever it is doing.
//!
//! In step mode the averager keeps its own copy of the vector between steps, and exchanges
//! answered between two steps change that copy; the next [`GossipAverager::step`] adds what
//! changed in the caller's tensors since the last step (its training) to it, runs the round,
//! and writes the result back. So nothing averaged between steps is lost, and the caller's
//! tensors are only written inside `step`. [`GossipAverager::values`] reads the copy.
//!
//! Not done: the group averager's router multiplexes rounds; gossip has one averager per node
//! (its own protocol, `/starling/averager/gossip/1`), sharing the transport (fast lane
//! included), the accept loops, the framing and the codecs' chunk format with it.

mod buffer;
mod config;
mod exchange;
mod handle;
mod membership;
mod mix;
mod proto;
mod report;
mod topology;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use starling_node::streams::InboundLimits;
use starling_node::{Node, PeerId};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};
use tracing::Instrument;

pub use buffer::GossipBuffer;
pub use config::GossipConfig;
pub use handle::GossipHandle;
pub use mix::{consensus_distance, weighted_mean};
pub use report::{Exchange, ExchangeOutcome, GossipReport, Role};
pub use topology::Topology;

use crate::averager::group_schema_hash;
use crate::router::{serve_lanes, MAX_INBOUND_HANDSHAKES};
use crate::transport::Transport;
use crate::wire::{Control, GOSSIP_PROTOCOL, MAX_CONTROL_BYTES};
use crate::AveragerError;
use membership::{Backoff, Member};
use starling_node::lock::lock;

/// The vector exchanges work on, and its schema.
#[derive(Clone)]
struct Served {
    buffer: GossipBuffer,
    schema: u64,
}

/// The live view of the members.
#[derive(Default)]
struct View {
    members: Vec<Member>,
    read_at: Option<Instant>,
    /// The schema last declared, and when.
    declared: Option<(u64, Instant)>,
}

/// Totals since the averager started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GossipTotals {
    /// Rounds this peer ran (steps and background ticks).
    pub rounds: u64,
    /// Exchanges averaged, either role.
    pub exchanges: u64,
    /// Bytes sent in exchanges (framing included).
    pub bytes_sent: u64,
    /// Bytes received in exchanges.
    pub bytes_received: u64,
}

/// State shared by the handle, the accept loops and the background loop.
pub(crate) struct Shared {
    config: GossipConfig,
    transport: Transport,
    key: String,
    served: Mutex<Option<Served>>,
    /// Held for the whole of an exchange, either role: one exchange at a time.
    exclusive: Arc<tokio::sync::Mutex<()>>,
    backoff: Mutex<Backoff>,
    view: Mutex<View>,
    /// Exchanges answered since the last report, with when they ended.
    served_log: Mutex<VecDeque<(Instant, Exchange)>>,
    seed: u64,
    rounds: AtomicU64,
    exchanges: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    background: AtomicBool,
}

impl Shared {
    fn served(&self) -> Option<Served> {
        lock(&self.served).clone()
    }

    fn count(&self, ex: &Exchange) {
        if ex.averaged() {
            self.exchanges.fetch_add(1, Ordering::Relaxed);
        }
        self.bytes_sent.fetch_add(ex.bytes_sent, Ordering::Relaxed);
        self.bytes_received
            .fetch_add(ex.bytes_received, Ordering::Relaxed);
    }

    fn log_served(&self, ex: Exchange) {
        let mut log = lock(&self.served_log);
        if log.len() >= exchange::MAX_SERVED_LOG {
            log.pop_front();
        }
        log.push_back((Instant::now(), ex));
    }

    /// Declares this peer (when due) and re-reads the members (when due), each bounded by the
    /// request timeout and `deadline`; `force` does both now.
    async fn refresh(
        &self,
        schema: u64,
        deadline: Instant,
        force: bool,
    ) -> Result<(), AveragerError> {
        let cfg = &self.config;
        let node = self.transport.node();
        let limit = cfg
            .request_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        let (declare_due, read_due) = {
            let v = lock(&self.view);
            let declare = force
                || v.declared
                    .is_none_or(|(s, at)| s != schema || at.elapsed() >= cfg.membership_ttl / 3);
            let read = force
                || declare
                || v.read_at
                    .is_none_or(|at| at.elapsed() >= cfg.membership_refresh);
            (declare, read)
        };
        if declare_due {
            membership::declare(node, &self.key, schema, cfg.membership_ttl, limit).await?;
            lock(&self.view).declared = Some((schema, Instant::now()));
        }
        if read_due {
            if let Some(members) = membership::read(node, &self.key, schema, limit).await? {
                let mut v = lock(&self.view);
                v.members = members;
                v.read_at = Some(Instant::now());
            }
        }
        Ok(())
    }

    /// One round: refresh the view when due, then exchange with this round's targets in turn.
    async fn run_round(&self, deadline: Instant) -> Result<GossipReport, AveragerError> {
        let started = Instant::now();
        let round = self.rounds.fetch_add(1, Ordering::Relaxed);
        let Some(served) = self.served() else {
            return Err(AveragerError::Config("nothing to gossip".into()));
        };
        self.refresh(served.schema, deadline, false).await?;
        let me = self.transport.node().peer_id();
        let live: Vec<Member> = {
            let view = lock(&self.view);
            let backoff = lock(&self.backoff);
            view.members
                .iter()
                .filter(|m| m.peer == me || !backoff.skipped(&m.peer, Instant::now()))
                .cloned()
                .collect()
        };
        let rank = live.iter().position(|m| m.peer == me);
        let targets: Vec<Member> = rank
            .map(|r| {
                self.config
                    .topology
                    .targets(r, live.len(), round, self.seed)
                    .into_iter()
                    .map(|j| live[j].clone())
                    .collect()
            })
            .unwrap_or_default();
        let mut exchanges = Vec::with_capacity(targets.len());
        for target in &targets {
            if Instant::now() >= deadline {
                break;
            }
            // Already averaged with it this round (it initiated first): no second exchange.
            let done = lock(&self.served_log)
                .iter()
                .any(|(at, e)| *at >= started && e.peer == target.peer && e.averaged());
            if done {
                continue;
            }
            exchanges.push(exchange::initiate(self, target, deadline).await);
        }
        let served: Vec<Exchange> = lock(&self.served_log).drain(..).map(|(_, e)| e).collect();
        let (bytes_sent, bytes_received) = exchanges
            .iter()
            .chain(&served)
            .fold((0, 0), |(s, r), e| (s + e.bytes_sent, r + e.bytes_received));
        Ok(GossipReport {
            round,
            members: live.len(),
            rank,
            targets: targets.iter().map(|m| m.peer).collect(),
            exchanges,
            served,
            bytes_sent,
            bytes_received,
            duration: started.elapsed(),
        })
    }
}

/// The step mode's own copy of the vector, and the values the caller got at the last step.
#[derive(Default)]
struct StepState {
    buffer: Option<GossipBuffer>,
    /// What the caller's tensors held after the last step: their change since is its training.
    mark: Vec<f32>,
}

/// Averages flat `f32` tensors with neighbours chosen by a [`Topology`] over the live members of
/// the run (see the [module docs](self)).
///
/// ```no_run
/// # async fn demo(node: starling_node::Node) -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use starling_averager::gossip::{GossipAverager, GossipBuffer, GossipConfig};
/// let gossip = GossipAverager::new(node, GossipConfig::new("my-run")).await?;
/// let params = GossipBuffer::new(vec![0.0f32; 1000], 1.0)?;
/// let background = gossip.start_background(params.clone(), Duration::from_millis(100))?;
/// for _ in 0..100 {
///     params.update(|p| p.iter_mut().for_each(|v| *v -= 0.01)); // a local step
/// }
/// background.stop().await;
/// gossip.shutdown().await;
/// # Ok(()) }
/// ```
pub struct GossipAverager {
    shared: Arc<Shared>,
    step_state: tokio::sync::Mutex<StepState>,
    tasks: Vec<JoinHandle<()>>,
    runtime: tokio::runtime::Handle,
}

impl GossipAverager {
    /// Starts answering gossip exchanges on `node` (one gossip averager per node; a group
    /// [`Averager`](crate::Averager) may run beside it). It joins the members with its first
    /// round.
    pub async fn new(node: Node, config: GossipConfig) -> Result<Self, AveragerError> {
        config.validate()?;
        let span = tracing::debug_span!(parent: node.span(), "gossip");
        let shared = Arc::new(Shared {
            transport: Transport::new(node.clone(), config.fast_lane, config.request_timeout),
            key: membership::key(&config.prefix),
            served: Mutex::new(None),
            exclusive: Arc::new(tokio::sync::Mutex::new(())),
            backoff: Mutex::new(Backoff::default()),
            view: Mutex::new(View::default()),
            served_log: Mutex::new(VecDeque::new()),
            seed: rand::random(),
            rounds: AtomicU64::new(0),
            exchanges: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            background: AtomicBool::new(false),
            config,
        });
        let streams = node
            .stream_control()
            .accept(GOSSIP_PROTOCOL)
            .map_err(|_| AveragerError::AlreadyRunning)?;
        let limits = InboundLimits {
            max_pending: MAX_INBOUND_HANDSHAKES,
            first_message_timeout: shared.config.request_timeout,
            max_first_message: MAX_CONTROL_BYTES + 1,
        };
        let handler = {
            let shared = Arc::downgrade(&shared);
            move |peer: PeerId, Control::Control(msg), lane| {
                let shared = shared.clone();
                async move {
                    if let Some(shared) = shared.upgrade() {
                        exchange::respond(&shared, peer, msg, lane).await;
                    }
                }
            }
        };
        let tasks = {
            let _entered = span.enter();
            serve_lanes(
                &node,
                streams,
                GOSSIP_PROTOCOL,
                shared.config.fast_lane,
                limits,
                handler,
            )?
        };
        Ok(GossipAverager {
            shared,
            step_state: tokio::sync::Mutex::new(StepState::default()),
            tasks,
            runtime: tokio::runtime::Handle::current(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GossipConfig {
        &self.shared.config
    }

    /// One gossip round on `tensors` (all of them as one flat vector): their change since the
    /// last step is added to the averager's copy (which holds what exchanges answered since
    /// then did), this round's exchanges run, and the result is written back. `weight` (finite
    /// and at least 0; e.g. samples behind the values) is this peer's weight in the weighted mean, also
    /// for exchanges it answers until the next step. Returns when the round's exchanges are
    /// done, never after `deadline`; an exchange that failed or timed out changed nothing on
    /// this side, and the report says so.
    pub async fn step(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: std::time::Instant,
    ) -> Result<GossipReport, AveragerError> {
        buffer::check_weight(weight)?;
        let deadline = Instant::from_std(deadline);
        if deadline <= Instant::now() {
            return Err(AveragerError::Deadline("before the step began"));
        }
        if self.shared.background.load(Ordering::Acquire) {
            return Err(AveragerError::Config(
                "a background gossip loop runs on this averager: stop it before stepping".into(),
            ));
        }
        let mut state = self
            .step_state
            .try_lock()
            .map_err(|_| AveragerError::StepInProgress)?;
        let total: usize = tensors.iter().map(|t| t.len()).sum();
        if total == 0 {
            return Err(AveragerError::Schema("no elements to average".into()));
        }
        if let Some((i, _)) = tensors
            .iter()
            .enumerate()
            .find(|(_, t)| !t.iter().all(|v| v.is_finite()))
        {
            return Err(AveragerError::NonFinite(format!(
                "tensor {i} holds NaN or infinity"
            )));
        }
        let schema = self.schema(total);
        let state = &mut *state;
        let reuse =
            state.buffer.as_ref().is_some_and(|b| b.len() == total) && state.mark.len() == total;
        let buffer = if reuse {
            let b = state.buffer.clone().expect("checked above");
            let mark = &state.mark;
            b.with_lock(|v, w| {
                // v = caller's values + (what exchanges did since the last step).
                let mut at = 0;
                for t in tensors.iter() {
                    for (k, x) in t.iter().enumerate() {
                        v[at + k] = x + (v[at + k] - mark[at + k]);
                    }
                    at += t.len();
                }
                *w = weight;
            });
            b
        } else {
            let flat: Vec<f32> = tensors.iter().flat_map(|t| t.iter().copied()).collect();
            let b = GossipBuffer::new(flat, weight)?;
            state.buffer = Some(b.clone());
            b
        };
        *lock(&self.shared.served) = Some(Served {
            buffer: buffer.clone(),
            schema,
        });
        let report = self.shared.run_round(deadline).await;
        buffer.with_lock(|v, _| {
            let mut at = 0;
            for t in tensors.iter_mut() {
                t.copy_from_slice(&v[at..at + t.len()]);
                at += t.len();
            }
            state.mark.clear();
            state.mark.extend_from_slice(v);
        });
        report
    }

    /// [`GossipAverager::step`] from a plain thread (a training loop's), blocking it; never from
    /// inside an async runtime ([`AveragerError::BlockingInRuntime`]).
    ///
    /// ```no_run
    /// # fn demo(gossip: starling_averager::gossip::GossipAverager) -> Result<(), starling_averager::AveragerError> {
    /// use std::time::{Duration, Instant};
    /// let mut params = vec![0.0f32; 1000];
    /// let report = gossip.step_blocking(&mut [&mut params[..]], 1.0, Instant::now() + Duration::from_secs(5))?;
    /// println!("{} exchanges", report.exchanges.len());
    /// # Ok(()) }
    /// ```
    pub fn step_blocking(
        &self,
        tensors: &mut [&mut [f32]],
        weight: f32,
        deadline: std::time::Instant,
    ) -> Result<GossipReport, AveragerError> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(AveragerError::BlockingInRuntime);
        }
        self.runtime.block_on(self.step(tensors, weight, deadline))
    }

    /// Gossips continuously on `buffer`: a round every `interval` (measured from the end of the
    /// last one), answering exchanges all the while, until the returned handle is stopped or
    /// dropped. The caller trains on the same buffer ([`GossipBuffer::update`]). No
    /// [`GossipAverager::step`] meanwhile.
    ///
    /// ```no_run
    /// # async fn demo(gossip: starling_averager::gossip::GossipAverager) -> Result<(), starling_averager::AveragerError> {
    /// use std::time::Duration;
    /// use starling_averager::gossip::GossipBuffer;
    /// let params = GossipBuffer::new(vec![1.0f32; 10], 1.0)?;
    /// let handle = gossip.start_background(params.clone(), Duration::from_millis(50))?;
    /// tokio::time::sleep(Duration::from_secs(1)).await;
    /// println!("{} rounds", handle.rounds());
    /// handle.stop().await;
    /// # Ok(()) }
    /// ```
    pub fn start_background(
        &self,
        buffer: GossipBuffer,
        interval: Duration,
    ) -> Result<GossipHandle, AveragerError> {
        if self
            .shared
            .background
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(AveragerError::Config(
                "a background gossip loop already runs on this averager".into(),
            ));
        }
        let Ok(state) = self.step_state.try_lock() else {
            self.shared.background.store(false, Ordering::Release);
            return Err(AveragerError::StepInProgress);
        };
        drop(state);
        let schema = self.schema(buffer.len());
        *lock(&self.shared.served) = Some(Served {
            buffer: buffer.clone(),
            schema,
        });
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let (report_tx, report_rx) = watch::channel(None);
        let shared = self.shared.clone();
        let round_limit = shared.config.exchange_timeout * 2 + shared.config.busy_patience;
        let span =
            tracing::debug_span!(parent: shared.transport.node().span(), "gossip-background");
        let task = tokio::spawn(
            async move {
                loop {
                    let deadline = Instant::now() + round_limit;
                    let round = tokio::select! {
                        _ = stop_rx.changed() => break,
                        r = shared.run_round(deadline) => r,
                    };
                    match round {
                        Ok(r) => {
                            report_tx.send_replace(Some(r));
                        }
                        Err(AveragerError::Node(e)) => {
                            tracing::debug!("background gossip stops: {e}");
                            break;
                        }
                        Err(e) => tracing::debug!("background gossip round: {e}"),
                    }
                    tokio::select! {
                        _ = stop_rx.changed() => break,
                        _ = tokio::time::sleep(interval) => {}
                    }
                }
            }
            .instrument(span),
        );
        Ok(GossipHandle {
            shared: self.shared.clone(),
            buffer,
            stop: stop_tx,
            reports: report_rx,
            task: Some(task),
        })
    }

    /// What this peer holds now (the vector exchanges work on: the last step's result plus the
    /// exchanges answered since, or the background buffer), once the exchange in flight, if
    /// any, has ended (waiting at most the exchange timeout). `None` before the first step.
    pub async fn values(&self) -> Option<Vec<f32>> {
        let wait = self.shared.config.exchange_timeout;
        let _guard = timeout(wait, self.shared.exclusive.clone().lock_owned()).await;
        self.shared.served().map(|s| s.buffer.snapshot())
    }

    /// The live members as of the last read (this peer included), in rank order, less the
    /// peers being skipped after failures.
    pub fn members(&self) -> Vec<PeerId> {
        let view = lock(&self.shared.view);
        let backoff = lock(&self.shared.backoff);
        view.members
            .iter()
            .filter(|m| !backoff.skipped(&m.peer, Instant::now()))
            .map(|m| m.peer)
            .collect()
    }

    /// Declares this peer and re-reads the members now (after the first step or background
    /// start; before, there is no schema to declare), bounded by the request timeout. Returns
    /// the live members' count.
    pub async fn refresh_members(&self) -> Result<usize, AveragerError> {
        let Some(served) = self.shared.served() else {
            return Err(AveragerError::Config(
                "nothing to gossip yet: step or start the background loop first".into(),
            ));
        };
        let deadline = Instant::now() + self.shared.config.request_timeout;
        self.shared.refresh(served.schema, deadline, true).await?;
        Ok(self.members().len())
    }

    /// Totals since the averager started.
    pub fn totals(&self) -> GossipTotals {
        let s = &self.shared;
        GossipTotals {
            rounds: s.rounds.load(Ordering::Relaxed),
            exchanges: s.exchanges.load(Ordering::Relaxed),
            bytes_sent: s.bytes_sent.load(Ordering::Relaxed),
            bytes_received: s.bytes_received.load(Ordering::Relaxed),
        }
    }

    /// Stops answering exchanges (exchanges in flight end by their timeouts; peers see this one
    /// as failed from now on). Stop a background loop with [`GossipHandle::stop`] first to end
    /// its last round cleanly.
    pub async fn shutdown(mut self) {
        *lock(&self.shared.served) = None;
        for t in self.tasks.drain(..) {
            t.abort();
            let _ = t.await;
        }
    }

    fn schema(&self, len: usize) -> u64 {
        group_schema_hash(&[len], &format!("gossip/{}", self.shared.config.codec))
    }
}

impl Drop for GossipAverager {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
