//! A node's metrics: one Prometheus registry per node, shared by everything that runs on it.
//!
//! The node creates a [`Metrics`] at start and hands it out with [`Node::metrics`](crate::Node::metrics).
//! It holds:
//! - the Prometheus [`Registry`] (`prometheus-client`): libp2p's own metrics (`libp2p_*`,
//!   recorded by the swarm task, and `libp2p_bandwidth_*` from the transport), the node's
//!   (`starling_node_*`: peers connected, routing table, DHT records, DHT query latency), and
//!   whatever the components running on the node register with [`Metrics::component`]
//!   (the averager's, the experts server's, training's), all under the `starling_` prefix;
//! - two short journals for dashboards: recent averaging rounds ([`RoundRecord`]) and the loss
//!   curve ([`LossPoint`]), each a ring bounded to [`JOURNAL_LEN`] entries;
//! - the **board**: what this node tells the swarm about itself in its heartbeat
//!   ([`crate::heartbeat`]): measured bandwidth, training progress, experts hosted.
//!
//! Everything here is cheap to update (atomics, short critical sections never held across an
//! await) and bounded. [`Metrics::encode`] gives the Prometheus text exposition format.
//!
//! ```
//! use prometheus_client::metrics::counter::Counter;
//! use starling_node::metrics::Metrics;
//!
//! #[derive(Clone, Default)]
//! struct MyMetrics { jobs: Counter }
//!
//! let metrics = Metrics::new();
//! // One instance per node and type: later calls get a handle to the same counters.
//! let mine = metrics.component(|registry| {
//!     let m = MyMetrics::default();
//!     registry.register("my_jobs", "Jobs done", m.jobs.clone());
//!     m
//! });
//! mine.jobs.inc();
//! assert!(metrics.encode().contains("starling_my_jobs_total 1"));
//! ```

use std::any::{Any, TypeId};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use starling_dht::lock::lock;

/// Entries kept in each journal (recent rounds, loss curve); older ones are dropped.
pub const JOURNAL_LEN: usize = 512;

/// Prefix of every metric Starling registers (libp2p's keep their own `libp2p_` prefix).
pub const PREFIX: &str = "starling";

/// Buckets for latencies in seconds: 1 ms to about 65 s, doubling.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 17)
}

/// One averaging round as the dashboard shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundRecord {
    /// When the round ended (unix ms).
    pub time_ms: u64,
    /// The group's round id (0 when no group was found).
    pub round_id: u64,
    /// Members in the group, this peer included (0 when no group was found).
    pub group_size: usize,
    /// `ok` (everything averaged with everyone), `partial` (some spans kept local or a member
    /// failed) or `failed` (no round: no group, an error).
    pub outcome: String,
    /// Fraction of this peer's elements averaged with at least one other peer.
    pub averaged_fraction: f64,
    /// Bytes this peer wrote to averaging streams.
    pub bytes_sent: u64,
    /// Bytes this peer read from averaging streams.
    pub bytes_received: u64,
    /// Seconds spent in the all-reduce.
    pub allreduce_seconds: f64,
    /// What went wrong, for failed rounds.
    pub error: Option<String>,
}

/// One point of the loss curve this node's training reported.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossPoint {
    /// When it was reported (unix ms).
    pub time_ms: u64,
    /// The run's epoch (global step) at the time.
    pub epoch: u64,
    /// The training loss.
    pub loss: f64,
}

/// Training progress, as a node tells the swarm in its heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingInfo {
    /// The run's name.
    pub run: String,
    /// The run's epoch this peer is at.
    pub epoch: u64,
    /// This peer's training rate.
    pub samples_per_second: f64,
    /// The last loss this peer reported (NaN-free: `None` until there is one).
    pub loss: Option<f64>,
}

/// What this node tells the swarm about itself (see [`crate::heartbeat`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Board {
    /// Measured averaging bandwidth, bytes per second (0: not measured).
    pub bandwidth: f64,
    /// The training run this node takes part in, if any.
    pub training: Option<TrainingInfo>,
    /// Uids of the experts this node hosts.
    pub experts: Vec<String>,
}

/// Labels of the DHT query latency histogram.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueryLabels {
    /// `get` or `put`.
    kind: &'static str,
    /// `ok` or `error`.
    outcome: &'static str,
}

/// The node's own metrics.
#[derive(Clone)]
pub(crate) struct NodeMetrics {
    pub peers_connected: Gauge,
    pub routing_table: Gauge,
    pub dht_records: Gauge,
    pub dht_record_bytes: Gauge,
    query_seconds: Family<QueryLabels, Histogram>,
}

/// A node's metrics registry, journals and board. Cheap to clone: clones share everything.
/// See the [module docs](self) for an example.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Mutex<Registry>,
    components: Mutex<HashMap<TypeId, Box<dyn Any + Send + Sync>>>,
    node: NodeMetrics,
    /// libp2p's metrics, set once at start (read on every swarm event: no lock).
    libp2p: std::sync::OnceLock<libp2p::metrics::Metrics>,
    rounds: Mutex<VecDeque<RoundRecord>>,
    loss: Mutex<VecDeque<LossPoint>>,
    board: Mutex<Board>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with the node's own metrics registered.
    ///
    /// ```
    /// let metrics = starling_node::metrics::Metrics::new();
    /// assert!(metrics.encode().contains("starling_node_peers_connected"));
    /// ```
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let node = NodeMetrics {
            peers_connected: Gauge::default(),
            routing_table: Gauge::default(),
            dht_records: Gauge::default(),
            dht_record_bytes: Gauge::default(),
            query_seconds: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
        };
        {
            let r = registry.sub_registry_with_prefix(PREFIX);
            r.register(
                "node_peers_connected",
                "Peers with at least one open connection",
                node.peers_connected.clone(),
            );
            r.register(
                "node_routing_table_peers",
                "Peers in the Kademlia routing table",
                node.routing_table.clone(),
            );
            r.register(
                "node_dht_records",
                "DHT keys held in the local store",
                node.dht_records.clone(),
            );
            r.register(
                "node_dht_record_bytes",
                "Bytes of DHT records held in the local store",
                node.dht_record_bytes.clone(),
            );
            r.register_with_unit(
                "node_dht_query",
                "Latency of DHT queries started by this node, by kind and outcome",
                prometheus_client::registry::Unit::Seconds,
                node.query_seconds.clone(),
            );
        }
        Metrics {
            inner: Arc::new(Inner {
                registry: Mutex::new(registry),
                components: Mutex::new(HashMap::new()),
                node,
                libp2p: std::sync::OnceLock::new(),
                rounds: Mutex::new(VecDeque::new()),
                loss: Mutex::new(VecDeque::new()),
                board: Mutex::new(Board::default()),
            }),
        }
    }

    /// The metrics of component type `T` on this node: registered by `make` (into a registry
    /// whose names get the `starling_` prefix) the first time, the same instance afterwards.
    /// `T` should be a cloneable bundle of `prometheus-client` metrics (they share their values
    /// between clones). See the [module docs](self).
    pub fn component<T: Clone + Send + Sync + 'static>(
        &self,
        make: impl FnOnce(&mut Registry) -> T,
    ) -> T {
        let mut components = lock(&self.inner.components);
        if let Some(existing) = components
            .get(&TypeId::of::<T>())
            .and_then(|b| b.downcast_ref::<T>())
        {
            return existing.clone();
        }
        let made = {
            let mut registry = lock(&self.inner.registry);
            make(registry.sub_registry_with_prefix(PREFIX))
        };
        components.insert(TypeId::of::<T>(), Box::new(made.clone()));
        made
    }

    /// The root registry (no prefix), for libp2p's transport metrics.
    pub(crate) fn root(&self) -> std::sync::MutexGuard<'_, Registry> {
        lock(&self.inner.registry)
    }

    /// Registers libp2p's behaviour and swarm metrics (once).
    pub(crate) fn init_libp2p(&self) {
        self.inner
            .libp2p
            .get_or_init(|| libp2p::metrics::Metrics::new(&mut lock(&self.inner.registry)));
    }

    /// Records a libp2p event in libp2p's metrics.
    pub(crate) fn record_libp2p<E>(&self, event: &E)
    where
        libp2p::metrics::Metrics: libp2p::metrics::Recorder<E>,
    {
        use libp2p::metrics::Recorder;
        if let Some(m) = self.inner.libp2p.get() {
            m.record(event);
        }
    }

    /// The node's own gauges.
    pub(crate) fn node(&self) -> &NodeMetrics {
        &self.inner.node
    }

    /// Records how long a DHT query of `kind` (`get`, `put`) took.
    pub(crate) fn observe_query(&self, kind: &'static str, ok: bool, took: Duration) {
        let outcome = if ok { "ok" } else { "error" };
        self.inner
            .node
            .query_seconds
            .get_or_create(&QueryLabels { kind, outcome })
            .observe(took.as_secs_f64());
    }

    /// Everything registered, in the Prometheus text exposition format (ends with `# EOF`).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let registry = lock(&self.inner.registry);
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
            // Writing to a String cannot fail; keep the endpoint serving if it ever does.
            tracing::warn!("encoding metrics: {e}");
        }
        out
    }

    /// Adds a round to the recent-rounds journal (the oldest goes beyond [`JOURNAL_LEN`]).
    pub fn push_round(&self, round: RoundRecord) {
        push_bounded(&mut lock(&self.inner.rounds), round);
    }

    /// The recent rounds, oldest first.
    ///
    /// ```
    /// use starling_node::metrics::{Metrics, RoundRecord};
    /// let m = Metrics::new();
    /// m.push_round(RoundRecord { time_ms: 1, round_id: 7, group_size: 4, outcome: "ok".into(),
    ///     averaged_fraction: 1.0, bytes_sent: 10, bytes_received: 10, allreduce_seconds: 0.1,
    ///     error: None });
    /// assert_eq!(m.rounds()[0].round_id, 7);
    /// ```
    pub fn rounds(&self) -> Vec<RoundRecord> {
        lock(&self.inner.rounds).iter().cloned().collect()
    }

    /// Adds a point to the loss curve (non-finite losses are ignored) and sets the board's
    /// training loss.
    pub fn push_loss(&self, point: LossPoint) {
        if !point.loss.is_finite() {
            return;
        }
        push_bounded(&mut lock(&self.inner.loss), point);
        if let Some(t) = lock(&self.inner.board).training.as_mut() {
            t.loss = Some(point.loss);
        }
    }

    /// The loss curve, oldest first.
    ///
    /// ```
    /// use starling_node::metrics::{LossPoint, Metrics};
    /// let m = Metrics::new();
    /// m.push_loss(LossPoint { time_ms: 1, epoch: 3, loss: 0.5 });
    /// m.push_loss(LossPoint { time_ms: 2, epoch: 4, loss: f64::NAN }); // ignored
    /// assert_eq!(m.loss().len(), 1);
    /// ```
    pub fn loss(&self) -> Vec<LossPoint> {
        lock(&self.inner.loss).iter().copied().collect()
    }

    /// What this node currently tells the swarm about itself.
    pub fn board(&self) -> Board {
        lock(&self.inner.board).clone()
    }

    /// Updates the board in place.
    ///
    /// ```
    /// let m = starling_node::metrics::Metrics::new();
    /// m.update_board(|b| b.experts = vec!["ffn.0.1".into()]);
    /// assert_eq!(m.board().experts.len(), 1);
    /// ```
    pub fn update_board(&self, f: impl FnOnce(&mut Board)) {
        f(&mut lock(&self.inner.board))
    }
}

fn push_bounded<T>(ring: &mut VecDeque<T>, item: T) {
    while ring.len() >= JOURNAL_LEN {
        ring.pop_front();
    }
    ring.push_back(item);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journals_are_bounded_and_components_registered_once() {
        let m = Metrics::new();
        for i in 0..(JOURNAL_LEN as u64 + 10) {
            m.push_loss(LossPoint {
                time_ms: i,
                epoch: i,
                loss: 1.0,
            });
        }
        let loss = m.loss();
        assert_eq!(loss.len(), JOURNAL_LEN);
        assert_eq!(loss[0].epoch, 10);

        #[derive(Clone, Default)]
        struct C(prometheus_client::metrics::counter::Counter);
        let mut made = 0;
        for _ in 0..3 {
            let c = m.component(|r| {
                made += 1;
                let c = C::default();
                r.register("c", "a counter", c.0.clone());
                c
            });
            c.0.inc();
        }
        assert_eq!(made, 1);
        assert!(m.encode().contains("starling_c_total 3"));
    }
}
