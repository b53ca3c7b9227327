//! A node's metrics: one Prometheus registry per node, shared by everything that runs on it.
//!
//! The node creates a [`Metrics`] at start and hands it out with [`Node::metrics`](crate::Node::metrics).
//! It holds:
//! - the Prometheus [`Registry`] (`prometheus-client`): libp2p's own metrics (`libp2p_*`,
//!   recorded by the swarm task, and `libp2p_bandwidth_*` from the transport), the node's
//!   (`starling_node_*`: peers connected, routing table, DHT records, DHT query latency), and
//!   whatever the components running on the node register with [`Metrics::component`]
//!   (the averager's, the experts server's, training's), all under the `starling_` prefix;
//! - short journals for dashboards ([`Journal`], one per record type, each a ring bounded to
//!   [`JOURNAL_LEN`] entries): the averager keeps its recent rounds there, training its loss
//!   curve;
//! - the **board** ([`crate::board`]): what this node tells the swarm about itself in its
//!   heartbeat ([`crate::heartbeat`]), as sections the components fill.
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

use starling_dht::lock::lock;

use crate::board::Board;

/// Entries kept in each journal (recent rounds, loss curve); older ones are dropped.
pub const JOURNAL_LEN: usize = 512;

/// Prefix of every metric Starling registers (libp2p's keep their own `libp2p_` prefix).
pub const PREFIX: &str = "starling";

/// Buckets for latencies in seconds: 1 ms to about 65 s, doubling.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 17)
}

/// A bounded journal of recent records of one type (oldest dropped beyond [`JOURNAL_LEN`]):
/// one per node and type ([`Metrics::journal`]), shared between clones. Components keep what a
/// dashboard shows in them (the averager its rounds, training its loss curve).
///
/// ```
/// let m = starling_node::metrics::Metrics::new();
/// #[derive(Clone, Debug, PartialEq)]
/// struct Round(u64);
/// m.journal::<Round>().push(Round(7));
/// assert_eq!(m.journal::<Round>().entries(), vec![Round(7)]);
/// ```
pub struct Journal<T> {
    ring: Arc<Mutex<VecDeque<T>>>,
}

impl<T> Clone for Journal<T> {
    fn clone(&self) -> Self {
        Journal {
            ring: self.ring.clone(),
        }
    }
}

impl<T> Default for Journal<T> {
    fn default() -> Self {
        Journal {
            ring: Arc::new(Mutex::new(VecDeque::new())),
        }
    }
}

impl<T: Clone> Journal<T> {
    /// Adds a record (the oldest goes beyond [`JOURNAL_LEN`]).
    pub fn push(&self, item: T) {
        let mut ring = lock(&self.ring);
        while ring.len() >= JOURNAL_LEN {
            ring.pop_front();
        }
        ring.push_back(item);
    }

    /// The records, oldest first.
    pub fn entries(&self) -> Vec<T> {
        lock(&self.ring).iter().cloned().collect()
    }
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
    pub connections_pruned: prometheus_client::metrics::counter::Counter,
    pub peers_down: prometheus_client::metrics::counter::Counter,
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
            connections_pruned: Default::default(),
            peers_down: Default::default(),
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
            r.register(
                "node_connections_pruned",
                "Peers disconnected by the connection manager (over its high-water mark)",
                node.connections_pruned.clone(),
            );
            r.register(
                "node_peers_down",
                "Peers found down: their last connection closed abnormally and their TCP \
                 addresses then refused connections (dials to them denied for a while)",
                node.peers_down.clone(),
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

    /// Records how long a DHT query of `kind` (`get`, `put`) on `key` took (the latency
    /// histogram, and a debug line under the target `starling_node::query`).
    pub(crate) fn observe_query(&self, kind: &'static str, key: &str, ok: bool, took: Duration) {
        let outcome = if ok { "ok" } else { "error" };
        // Which key each operation went to, for counting a run's operations from its log
        // (`RUST_LOG=starling_node::query=debug`); the histogram has no key label.
        tracing::debug!(target: "starling_node::query", key, kind, outcome, ?took);
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

    /// The journal of records of type `T` on this node (created empty the first time). See
    /// [`Journal`].
    pub fn journal<T: Clone + Send + Sync + 'static>(&self) -> Journal<T> {
        self.component(|_| Journal::<T>::default())
    }

    /// What this node currently tells the swarm about itself.
    pub fn board(&self) -> Board {
        lock(&self.inner.board).clone()
    }

    /// Updates the board in place.
    pub fn update_board<R>(&self, f: impl FnOnce(&mut Board) -> R) -> R {
        f(&mut lock(&self.inner.board))
    }

    /// Sets section `S` of the board (see [`crate::board`]); a section that does not fit is
    /// logged and left out.
    ///
    /// ```
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Experts(Vec<String>);
    /// impl starling_node::board::Section for Experts {
    ///     const NAME: &'static str = "experts";
    ///     const VERSION: u32 = 1;
    /// }
    /// let m = starling_node::metrics::Metrics::new();
    /// m.set_section(&Experts(vec!["ffn.0.1".into()]));
    /// assert_eq!(m.board().get::<Experts>().unwrap().0.len(), 1);
    /// ```
    pub fn set_section<S: crate::board::Section>(&self, value: &S) {
        if let Err(e) = self.update_board(|b| b.put(value)) {
            tracing::warn!("{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journals_are_bounded_and_components_registered_once() {
        let m = Metrics::new();
        for i in 0..(JOURNAL_LEN as u64 + 10) {
            m.journal::<u64>().push(i);
        }
        let kept = m.journal::<u64>().entries();
        assert_eq!(kept.len(), JOURNAL_LEN);
        assert_eq!(kept[0], 10);

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
