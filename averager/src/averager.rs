//! The [`Averager`] handle: it owns the protocol servers (through the [`Router`]) and the
//! state kept from round to round: bandwidth estimate, buffer pool, grid position, round tag
//! and the previous round's repair server. One step (`step.rs`) = flatten and check the
//! tensors, find a group ([`matchmaking`](crate::matchmaking)), run the all-reduce
//! ([`allreduce`](crate::allreduce)), write the averaged spans back; `compressed.rs` holds the
//! low-rank and sparse rounds, `prepared.rs` searches started ahead of their step,
//! `reconcile.rs` the state reconciliation, `schema.rs` what a group must agree on.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use starling_node::{Node, PeerId, Reachability};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::Instrument;

use crate::allreduce::RoundEnv;
use crate::bandwidth::Bandwidth;
use crate::group::Group;
use crate::matchmaking::Matchmaker;
use crate::pool::BufPool;
use crate::router::Router;
use crate::transport::Transport;
use crate::verify::{watch_evidence, Banned, Signer};
use crate::wire::MemberInfo;
use crate::{AveragerConfig, AveragerError, AveragingMode};
use prepared::Prepared;
use starling_node::lock::lock;

mod compressed;
mod prepared;
mod reconcile;
mod schema;
mod step;
pub use reconcile::Reconciliation;
pub(crate) use schema::group_schema_hash;

/// Averages flat `f32` tensors with other peers of the swarm.
///
/// One call to [`Averager::step`] (or [`Averager::step_blocking`] from a plain thread) finds a
/// group through the DHT and runs a butterfly all-reduce with it; the tensors are replaced by
/// the group's weighted mean (on the spans that could be averaged, see [`RoundReport`](crate::RoundReport)) only
/// when the round completes. The crate docs explain matchmaking and the all-reduce.
///
/// ```no_run
/// # async fn train() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::{Duration, Instant};
/// use starling_averager::{Averager, AveragerConfig};
/// use starling_node::{Node, NodeConfig};
///
/// let node = Node::start(NodeConfig::default()).await?;
/// let averager = Averager::new(node, AveragerConfig::new("my-run")).await?;
/// let mut weights = vec![0.0f32; 1000];
/// let mut bias = vec![0.0f32; 10];
/// for step in 0..100 {
///     // ... a local optimizer step updates `weights` and `bias` (run heavy compute on its
///     // own thread or with `spawn_blocking`, not on the tokio workers that drive the network)
///     if step % 10 == 9 {
///         let deadline = Instant::now() + Duration::from_secs(30);
///         match averager.step(&mut [&mut weights[..], &mut bias[..]], 1.0, deadline).await {
///             Ok(report) => println!("averaged with {} peers", report.group.len()),
///             Err(e) => eprintln!("no averaging this time: {e}"), // training goes on
///         }
///     }
/// }
/// averager.shutdown().await;
/// # Ok(()) }
/// ```
pub struct Averager {
    config: Arc<AveragerConfig>,
    transport: Transport,
    router: Router,
    bandwidth: Bandwidth,
    /// Model-sized buffers kept from round to round.
    pool: Arc<BufPool>,
    /// This peer's group-key grid position (Moshpit rotation, `group_bits > 0`).
    grid_index: Mutex<u32>,
    /// The other members of the last group this peer averaged in (matchmaking skips its
    /// grace when they are all back or gone).
    last_group: Mutex<Vec<PeerId>>,
    /// The latest expiration this peer gave a matchmaking declaration (see `find_group`).
    declared_until: Arc<std::sync::atomic::AtomicU64>,
    /// How long the last join request took to be answered (ms; `u64::MAX` before the first).
    last_ask_ms: Arc<std::sync::atomic::AtomicU64>,
    /// The last round's background repair server: at most one at a time.
    repair_server: Mutex<Option<JoinHandle<()>>>,
    /// The schema this peer last announced, and until when the announcement lasts.
    announced: Mutex<Option<(u64, Instant)>>,
    busy: AtomicBool,
    /// A step's matchmaking is running (from the step's start until its group formed or the
    /// search failed): no search may be prepared meanwhile.
    searching: AtomicBool,
    /// Steps whose matchmaking has ended (see [`Averager::searches_done`]).
    searches_done: std::sync::atomic::AtomicU64,
    /// A search started ahead of its step (see [`Averager::prepare`]).
    prepared: Mutex<Option<Prepared>>,
    /// Peers expected to search in the next rounds (0: no hint), see [`Averager::expect_peers`].
    expected_peers: AtomicUsize,
    /// The start grace of the next searches in milliseconds (`u64::MAX`: the configuration's),
    /// see [`Averager::set_start_grace`].
    start_grace_ms: std::sync::atomic::AtomicU64,
    /// The round tag searches declare (see [`Averager::set_round_tag`]).
    round_tag: std::sync::atomic::AtomicU64,
    tasks: Vec<JoinHandle<()>>,
    runtime: tokio::runtime::Handle,
    /// Peers proven to have lied (see [`crate::verify`]): refused in matchmaking and rounds.
    banned: Banned,
    /// The latest rounds' groups, for [`Averager::reconcile`].
    recent_groups: Mutex<std::collections::VecDeque<Group>>,
}

/// A task that ends when its handle is dropped.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    async fn join(mut self) -> Result<T, tokio::task::JoinError> {
        (&mut self.0).await
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Clears the flags it holds when a step ends (or its search does), also when its future is
/// dropped half-way.
struct FlagGuard<'a>(&'a [&'a AtomicBool]);

impl Drop for FlagGuard<'_> {
    fn drop(&mut self) {
        for flag in self.0 {
            flag.store(false, Ordering::Release);
        }
    }
}

impl Averager {
    /// Starts serving the averaging protocols on `node`. One averager per node. Its tasks run
    /// on the current tokio runtime, inside an `averager` span under the node's `node{peer}` span.
    pub async fn new(node: Node, config: AveragerConfig) -> Result<Self, AveragerError> {
        config.validate()?;
        let config = Arc::new(config);
        let router = Router::new(config.request_timeout);
        let span = tracing::debug_span!(parent: node.span(), "averager");
        let banned = Banned::default();
        let tasks = {
            let _entered = span.enter();
            let mut tasks = router.serve(&node, config.fast_lane)?;
            if config.verify > 0.0 {
                let watch = watch_evidence(node.clone(), config.prefix.clone(), banned.clone());
                tasks.push(tokio::spawn(watch.in_current_span()));
            }
            tasks
        };
        let grid = if config.group_bits == 0 {
            0
        } else {
            rand::random::<u32>() % (1 << config.group_bits)
        };
        Ok(Averager {
            transport: Transport::new(node, config.fast_lane, config.request_timeout),
            bandwidth: Bandwidth::new(config.bandwidth, config.initial_bandwidth),
            router,
            pool: Arc::new(BufPool::default()),
            grid_index: Mutex::new(grid),
            last_group: Mutex::new(Vec::new()),
            declared_until: Arc::default(),
            last_ask_ms: Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX)),
            repair_server: Mutex::new(None),
            announced: Mutex::new(None),
            busy: AtomicBool::new(false),
            searching: AtomicBool::new(false),
            searches_done: std::sync::atomic::AtomicU64::new(0),
            prepared: Mutex::new(None),
            expected_peers: AtomicUsize::new(0),
            start_grace_ms: std::sync::atomic::AtomicU64::new(u64::MAX),
            round_tag: std::sync::atomic::AtomicU64::new(0),
            tasks,
            runtime: tokio::runtime::Handle::current(),
            config,
            banned,
            recent_groups: reconcile::no_groups(),
        })
    }

    /// Peers this averager refuses because it holds checked evidence that they lied in a
    /// round (caught by its own check, or read from the run's published evidence; see
    /// [`crate::verify`]). Empty unless [`AveragerConfig::verify`] is on.
    ///
    /// ```no_run
    /// # fn demo(averager: &starling_averager::Averager) {
    /// for peer in averager.refused_peers() {
    ///     println!("refusing {peer}: it returned a wrong result");
    /// }
    /// # }
    /// ```
    pub fn refused_peers(&self) -> Vec<PeerId> {
        self.banned.list()
    }

    /// Testing: refuse `peer` from now on, as if this averager had checked evidence that it
    /// lied (one peer learning of a liar before the others do).
    #[cfg(feature = "testing")]
    pub fn refuse_for_testing(&self, peer: &PeerId) {
        self.banned.insert(peer);
    }

    /// What a round run by this averager needs.
    pub(crate) fn round_env(&self, config: Arc<AveragerConfig>, feedback: bool) -> RoundEnv {
        RoundEnv {
            signer: (config.verify > 0.0).then(|| Signer::of(self.transport.node())),
            values_back: config.codec == starling_compression::Codec::None,
            config,
            transport: self.transport.clone(),
            router: self.router.clone(),
            pool: self.pool.clone(),
            bandwidth: self.bandwidth.current(),
            feedback,
            transcripts: self.router.transcripts(),
            banned: self.banned.clone(),
        }
    }

    /// A hint for the next rounds: about `peers` peers (this one included) will search, for
    /// example the live peers of a training run as its progress records say. A leader then
    /// starts its group as soon as it has `min(peers, target_group_size)` members (never fewer
    /// than `min_group_size`) instead of waiting out its matchmaking window for a group that
    /// cannot fill; peers that arrive later average in a later round. A previous group that
    /// held that many peers re-forms around its smallest peer id without reading the group key
    /// (see the crate docs, "Matchmaking"). `None` (the default) waits for `target_group_size`
    /// or the window's end.
    ///
    /// ```no_run
    /// # async fn demo(averager: starling_averager::Averager) {
    /// averager.expect_peers(Some(4)); // four peers train: a group of four need not wait
    /// # }
    /// ```
    pub fn expect_peers(&self, peers: Option<usize>) {
        self.expected_peers
            .store(peers.unwrap_or(0), Ordering::Relaxed);
    }

    /// Sets the start grace of the next searches (`AveragerConfig::start_grace`: how long a
    /// leader with every declared peer, but fewer than it expects, waits for the rest before it
    /// begins); `None` returns to the configuration's. For a training loop whose peers take
    /// about a batch's time to come to a round: a grace shorter than a batch starts the group
    /// without a peer that is merely finishing its batch.
    ///
    /// ```no_run
    /// # async fn demo(averager: starling_averager::Averager) {
    /// // Batches take about 0.8 s here: wait up to 1.2 s for the peers still computing.
    /// averager.set_start_grace(Some(std::time::Duration::from_millis(1200)));
    /// # }
    /// ```
    pub fn set_start_grace(&self, grace: Option<Duration>) {
        let ms = grace.map_or(u64::MAX, |g| (g.as_millis() as u64).min(u64::MAX - 1));
        self.start_grace_ms.store(ms, Ordering::Relaxed);
    }

    /// The configuration in force.
    pub fn config(&self) -> &AveragerConfig {
        &self.config
    }

    /// The bandwidth this peer currently declares (bytes per second).
    pub fn bandwidth(&self) -> f64 {
        self.bandwidth.current()
    }

    /// Tags this peer's next searches with `tag` (e.g. its training epoch; 0 until set): peers
    /// with different tags never group, and a search that meets a peer with a greater tag
    /// ends at once with [`AveragerError::Behind`] instead of waiting out its window, so a
    /// caller whose peers may disagree on which round they are in (one of them an epoch behind)
    /// finds out within one read of the group key. A prepared search with another tag is not
    /// used.
    ///
    /// ```no_run
    /// # async fn demo(averager: starling_averager::Averager, mut grads: Vec<f32>, epoch: u64) {
    /// use std::time::{Duration, Instant};
    /// use starling_averager::AveragerError;
    /// averager.set_round_tag(epoch);
    /// let deadline = Instant::now() + Duration::from_secs(10);
    /// match averager.step(&mut [&mut grads[..]], 1.0, deadline).await {
    ///     Err(AveragerError::Behind { theirs, .. }) => { /* catch up to `theirs`, step again */ }
    ///     _ => {}
    /// }
    /// # }
    /// ```
    pub fn set_round_tag(&self, tag: u64) {
        self.round_tag.store(tag, Ordering::Release);
    }

    /// The round tag searches declare now.
    pub fn round_tag(&self) -> u64 {
        self.round_tag.load(Ordering::Acquire)
    }

    /// The group key of a search for `schema` in grid cell `grid`, and the matchmaker for it.
    fn search_inputs(&self, schema: u64, grid: u32) -> (String, Matchmaker) {
        let cfg = &self.config;
        let group_key = format!("{}.averager.{schema:016x}.{grid}", cfg.prefix);
        let expected = self.expected_peers.load(Ordering::Relaxed);
        let grace = self.start_grace_ms.load(Ordering::Relaxed);
        let fewer = expected > 0 && expected < cfg.target_group_size;
        let config = if fewer || grace != u64::MAX {
            Arc::new(AveragerConfig {
                target_group_size: if fewer {
                    expected.max(cfg.min_group_size)
                } else {
                    cfg.target_group_size
                },
                start_grace: if grace != u64::MAX {
                    Some(Duration::from_millis(grace))
                } else {
                    cfg.start_grace
                },
                ..(**cfg).clone()
            })
        } else {
            cfg.clone()
        };
        let mm = Matchmaker {
            config,
            router: self.router.clone(),
            transport: self.transport.clone(),
            previous: lock(&self.last_group).clone(),
            declared_until: self.declared_until.clone(),
            last_ask_ms: self.last_ask_ms.clone(),
            expected: (expected > 0).then_some(expected),
            banned: self.banned.clone(),
        };
        (group_key, mm)
    }

    /// Keeps `server` (a finished round serving other members' re-delegated parts), ending the
    /// previous one: one lingering round at a time bounds the memory and tasks it holds.
    fn keep_repair_server(&self, server: Option<JoinHandle<()>>) {
        if let Some(old) = std::mem::replace(&mut *lock(&self.repair_server), server) {
            old.abort();
        }
    }

    /// Stops the accept loops and the last round's repair server. Rounds in flight on other
    /// peers see this peer as failed.
    pub async fn shutdown(mut self) {
        self.cancel_prepared();
        self.keep_repair_server(None);
        self.router.stop_parked();
        for t in self.tasks.drain(..) {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for Averager {
    fn drop(&mut self) {
        self.cancel_prepared();
        self.keep_repair_server(None);
        self.router.stop_parked();
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// This peer as a member of the group it searches for: the mode to declare (a `Node` peer that
/// cannot accept connections, because its node runs in client mode or autonat found it behind a
/// NAT, takes part as a `Client`, so that nobody waits on a reducer it cannot reach), its
/// bandwidth and its addresses.
async fn member_info(
    transport: &Transport,
    mode: AveragingMode,
    bandwidth: f64,
    tag: u64,
) -> Result<MemberInfo, AveragerError> {
    let node = transport.node();
    let reachability = node.status().await?.reachability;
    let mode = match (mode, reachability) {
        (AveragingMode::Node, Reachability::Client | Reachability::Private) => {
            tracing::debug!("this node accepts no inbound connections: averaging as a client");
            AveragingMode::Client
        }
        (AveragingMode::Aux, Reachability::Client | Reachability::Private) => {
            tracing::warn!(
                "an Aux averager behind a NAT or in client mode cannot be reached to reduce"
            );
            AveragingMode::Aux
        }
        (mode, _) => mode,
    };
    Ok(MemberInfo {
        peer_id: node.peer_id().to_bytes(),
        mode,
        bandwidth,
        addrs: node
            .listen_addrs()
            .await?
            .iter()
            .map(|a| a.to_string())
            .collect(),
        tag,
    })
}

#[cfg(test)]
mod tests;
