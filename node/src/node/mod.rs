//! The [`Node`] handle and how a node starts.
//!
//! - `mod.rs` (here): the handle, the public snapshot types, and [`Node::start`] as named steps;
//! - [`actor`]: the swarm task that owns the `Swarm` and the [`Command`]s handles send it;
//! - [`queries`]: Kademlia queries in flight and the Kademlia events that answer them;
//! - [`nat`]: reachability, relay reservations and hole punching, and the [`NatEvent`]s that
//!   report them;
//! - [`reach`]: reaching a given peer (`Node::connect_if_needed`);
//! - [`transport`]: building the swarm, bringing listeners up, multiaddr helpers.

mod actor;
mod connections;
mod nat;
mod queries;
mod reach;
mod transport;

use std::sync::Arc;
use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::kad::{Record, RecordKey};
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId, StreamProtocol};
use serde::{de::DeserializeOwned, Serialize};
use starling_dht::{encode_value, now_ms, DhtTime, DictionaryRecord, Entry, OwnerKey, Validator};
use tokio::sync::{broadcast, mpsc, oneshot};
use tracing::Instrument;

use crate::fastlane::{lane_ips, FastLane, FastStream, IncomingFast, PeerIpLookup};
use crate::metrics::Metrics;
use crate::{load_or_create_identity, owner_key_of, NodeConfig, NodeError};
use actor::{Actor, Command};
pub use nat::NatEvent;
use queries::GetMode;

/// How long [`Node::shutdown`] waits for the swarm task to stop.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether this node can be dialed from outside, as far as autonat can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Reachability {
    /// Not yet determined (or no servers to ask).
    Unknown,
    /// Other peers could dial us back.
    Public,
    /// Dial-backs failed: we are behind a NAT or firewall.
    Private,
    /// Running in client mode by choice.
    Client,
}

/// A snapshot of a node for status lines and monitoring.
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeStatus {
    /// This node's peer id.
    pub peer_id: String,
    /// Full dialable addresses (`.../p2p/<peer id>`).
    pub listen_addrs: Vec<String>,
    /// Peers with at least one open connection.
    pub connected_peers: usize,
    /// Peers in the Kademlia routing table.
    pub routing_table: usize,
    /// DHT keys held locally.
    pub records: usize,
    /// Bytes of DHT records held locally.
    pub record_bytes: usize,
    /// Inbound records refused since start.
    pub rejected_records: u64,
    /// Reachability as seen by autonat.
    pub reachability: Reachability,
}

/// What a Kademlia bootstrap (a lookup of this node's own id, then one per bucket to refresh)
/// met: how many peers answered its requests and how many could not be reached or refused, and
/// the routing table's size when it ended.
///
/// ```no_run
/// # async fn f(node: starling_node::Node) -> Result<(), starling_node::NodeError> {
/// let report = node.bootstrap().await?;
/// println!("{} peers answered, {} in the routing table", report.answered, report.routing_table);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BootstrapReport {
    /// Requests that peers answered, over every step.
    pub answered: u32,
    /// Requests that failed: the peer could not be dialled, refused the connection (e.g. at its
    /// connection ceiling) or did not answer in time.
    pub failed: u32,
    /// Peers in the Kademlia routing table when the bootstrap ended.
    pub routing_table: usize,
}

/// The outcome of a successful PUT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutReport {
    /// Remote peers that acknowledged the write (at least the configured quorum).
    pub acknowledged: usize,
}

/// A handle to a running node. Cheap to clone; all clones talk to the same swarm task, and every
/// call is a message to that task and an awaited reply (bounded by the request timeout where
/// the network is involved). When the task stops ([`Node::shutdown`] from any clone), calls fail
/// with [`NodeError::Closed`].
///
/// Two nodes on loopback, one joining through the other, sharing a DHT record:
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), starling_node::NodeError> {
/// use starling_node::{Node, NodeConfig};
/// let local = || NodeConfig::default().listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap());
/// let first = Node::start(local()).await?;
/// let addr = first.listen_addrs().await?.remove(0); // ends in /p2p/<first's peer id>
/// let second = Node::start(local().bootstrap_from(addr)).await?;
/// second.store("run/lr", "me", &0.1f64, starling_dht::now_ms() + 60_000).await?;
/// let lrs: Vec<(String, f64, u64)> = first.get("run/lr").await?;
/// assert_eq!(lrs[0].1, 0.1);
/// second.shutdown().await;
/// first.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Node {
    tx: mpsc::Sender<Command>,
    peer_id: PeerId,
    owner: OwnerKey,
    stream: crate::StreamControl,
    validator: Validator,
    request_timeout: Duration,
    fast: Option<Arc<FastLane>>,
    nat_events: Arc<nat::NatEvents>,
    metrics: Metrics,
    /// Peers found down ([`crate::down`]).
    down: crate::DownPeers,
    /// `node{peer=<short id>}`: entered by the swarm task and every task the node spawns.
    span: tracing::Span,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("peer_id", &self.peer_id)
            .finish()
    }
}

impl Node {
    /// Builds the swarm, starts listening, spawns the swarm task and, if bootstrap addresses are
    /// configured, joins the swarm through them (with retries). Fails with a clear error when no
    /// bootstrap peer answers. See [`Node`] for an example.
    pub async fn start(cfg: NodeConfig) -> Result<Node, NodeError> {
        let key = identity(&cfg)?;
        let span = node_span(&key.public().to_peer_id());
        Self::start_as(cfg, key, span.clone())
            .instrument(span)
            .await
    }

    /// [`Node::start`] once the identity is known, inside the node's span.
    async fn start_as(
        cfg: NodeConfig,
        key: Keypair,
        span: tracing::Span,
    ) -> Result<Node, NodeError> {
        let owner = owner_key_of(&key)
            .ok_or_else(|| NodeError::Config("identity must be an ed25519 key".into()))?;
        let listen = cfg.effective_listen();
        transport::check_private_swarm(&cfg, &listen)?;
        let metrics = Metrics::new();
        metrics.init_libp2p();
        let mut swarm = transport::build_swarm(&key, &cfg, &metrics)?;
        let peer_id = *swarm.local_peer_id();
        let usage = crate::control::StreamUsage::default();
        let stream =
            crate::StreamControl::new(swarm.behaviour().stream.new_control(), usage.clone());
        let validator = swarm.behaviour_mut().kad.store_mut().validator().clone();
        let down = swarm.behaviour().down.peers().clone();
        let listen_addrs = transport::start_listening(&mut swarm, &listen).await?;
        let (tx, rx) = mpsc::channel(cfg.command_queue.max(1));
        let fast = start_fast_lane(&cfg, &listen, stream.clone(), peer_ip_lookup(&tx)).await?;
        let nat_events = nat::NatEvents::new();
        let actor = Actor::new(
            swarm,
            listen_addrs,
            validator.clone(),
            &cfg,
            &nat_events,
            metrics.clone(),
            usage,
        )?;
        tokio::spawn(actor.run(rx).instrument(span.clone()));
        let node = Node {
            tx,
            peer_id,
            owner,
            stream,
            validator,
            request_timeout: cfg.request_timeout,
            fast,
            nat_events,
            metrics,
            down,
            span,
        };
        if !cfg.bootstrap.is_empty() {
            node.join(&cfg).await?;
        }
        Ok(node)
    }

    async fn join(&self, cfg: &NodeConfig) -> Result<(), NodeError> {
        let mut last_error = String::from("no attempt made");
        let mut backoff = cfg.bootstrap_backoff;
        let attempts = cfg.bootstrap_attempts.max(1);
        for attempt in 0..attempts {
            let dials = cfg.bootstrap.iter().map(|a| self.dial(a.clone()));
            let results = futures::future::join_all(dials).await;
            let mut connected = 0;
            for r in results {
                match r {
                    Ok(_) => connected += 1,
                    Err(e) => last_error = crate::error_chain(&e),
                }
            }
            if connected > 0 {
                self.fill_routing_table(cfg, connected, attempt, attempts, backoff)
                    .await;
                return Ok(());
            }
            if attempt + 1 < attempts {
                tracing::warn!(
                    attempt = attempt + 1,
                    "no bootstrap peer answered ({last_error}); retrying in {backoff:?}"
                );
                tokio::time::sleep(backoff).await;
                backoff *= 2;
            }
        }
        Err(NodeError::Bootstrap {
            tried: cfg.bootstrap.len(),
            attempts,
            last_error,
        })
    }

    /// The Kademlia bootstrap of a join, tried again (up to the join's remaining attempts, with
    /// its backoff) while it leaves the routing table holding only the bootstrap peers although
    /// some of the peers they named could not be reached: busy peers at their connection ceiling
    /// refuse new connections, and a node that stopped there would be cut off from the swarm
    /// once its connection to the bootstrap peer is pruned. A lone bootstrap peer (a new swarm)
    /// names nobody, so nothing failed and nothing is retried. Never fails the join: the node is
    /// connected, and later refreshes can fill the table.
    async fn fill_routing_table(
        &self,
        cfg: &NodeConfig,
        connected: usize,
        mut attempt: u32,
        attempts: u32,
        mut backoff: Duration,
    ) {
        loop {
            let result = match self.bootstrap().await {
                // A lookup that ran out of time may still have filled the table.
                Err(e) => match self.status().await {
                    Ok(s) if s.routing_table > connected => Ok(BootstrapReport {
                        routing_table: s.routing_table,
                        ..BootstrapReport::default()
                    }),
                    _ => Err(e),
                },
                ok => ok,
            };
            match result {
                Ok(r) if r.failed == 0 || r.routing_table > connected => {
                    tracing::info!(
                        connected,
                        routing_table = r.routing_table,
                        "joined the swarm"
                    );
                    return;
                }
                Ok(r) if attempt + 1 < attempts => tracing::debug!(
                    failed = r.failed,
                    routing_table = r.routing_table,
                    "bootstrap reached no peer beyond the bootstrap peers; retrying in {backoff:?}"
                ),
                Err(e) if attempt + 1 < attempts => {
                    tracing::debug!("bootstrap query: {e}; retrying in {backoff:?}")
                }
                r => {
                    tracing::warn!(
                        bootstrap_peers = cfg.bootstrap.len(),
                        "joined the swarm, but its bootstrap reached no other peer ({}); \
                         the routing table fills as peers are met",
                        match r {
                            Ok(r) => format!("{} requests failed", r.failed),
                            Err(e) => e.to_string(),
                        }
                    );
                    return;
                }
            }
            tokio::time::sleep(backoff).await;
            backoff *= 2;
            attempt += 1;
        }
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, NodeError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(make(tx))
            .await
            .map_err(|_| NodeError::Closed)?;
        rx.await.map_err(|_| NodeError::Closed)
    }

    /// Like [`Self::call`], but bounded by `timeout` (the swarm task enforces its own deadlines
    /// too; this one guards against a stalled task).
    async fn call_timeout<T>(
        &self,
        what: &'static str,
        timeout: Duration,
        make: impl FnOnce(oneshot::Sender<Result<T, NodeError>>) -> Command,
    ) -> Result<T, NodeError> {
        tokio::time::timeout(timeout, self.call(make))
            .await
            .map_err(|_| NodeError::Timeout(what))?
            .and_then(|r| r)
    }

    /// This node's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The node's tracing span, `node{peer=<short peer id>}`, which its own tasks run in. Run
    /// tasks that work for this node in it too, so that their logs say which node they belong
    /// to when several nodes share a process:
    ///
    /// ```no_run
    /// # async fn demo(node: starling_node::Node) {
    /// use tracing::Instrument;
    /// let watcher = node.clone();
    /// let task = async move {
    ///     let peers = watcher.connected_peers().await.map(|p| p.len());
    ///     tracing::info!(?peers, "connected"); // logged as `node{peer=…}: connected …`
    /// };
    /// tokio::spawn(task.instrument(node.span()));
    /// # }
    /// ```
    pub fn span(&self) -> tracing::Span {
        self.span.clone()
    }

    /// This node's metrics: its Prometheus registry (libp2p's metrics and the node's own), into
    /// which components running on the node register theirs, and the journals and board that
    /// dashboards and heartbeats read. See [`crate::metrics`].
    ///
    /// ```no_run
    /// # async fn demo(node: starling_node::Node) {
    /// let text = node.metrics().encode(); // Prometheus text exposition format
    /// assert!(text.contains("starling_node_peers_connected"));
    /// # }
    /// ```
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The key that signs this node's owner-protected DHT entries.
    pub fn owner_key(&self) -> &OwnerKey {
        &self.owner
    }

    /// The marker that makes a key or sub-key writable by this node only.
    pub fn owner_marker(&self) -> String {
        self.owner.marker()
    }

    /// Full dialable addresses of this node, each ending in `/p2p/<peer id>`.
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, NodeError> {
        let addrs = self.call(Command::ListenAddrs).await?;
        Ok(addrs
            .into_iter()
            .map(|a| a.with(Protocol::P2p(self.peer_id)))
            .collect())
    }

    /// Dials `addr` and waits until the connection is up (or fails, or times out).
    pub async fn dial(&self, addr: Multiaddr) -> Result<PeerId, NodeError> {
        self.call_timeout("dial", self.request_timeout * 2, |tx| {
            Command::Dial(addr, tx)
        })
        .await
    }

    /// Runs a Kademlia bootstrap (refreshes the routing table through known peers) and says what
    /// it met.
    pub async fn bootstrap(&self) -> Result<BootstrapReport, NodeError> {
        self.call_timeout("bootstrap", self.request_timeout * 6, Command::Bootstrap)
            .await
    }

    /// NAT traversal as it happens: reachability verdicts, relay reservations, hole punches
    /// (see [`NatEvent`]). The first call also gets the events since the node started (the
    /// last 64 at most); later calls get events from the moment of the call. A subscriber that
    /// falls far behind gets `Lagged`, then newer events.
    pub fn nat_events(&self) -> broadcast::Receiver<NatEvent> {
        self.nat_events.subscribe()
    }

    /// A status snapshot.
    pub async fn status(&self) -> Result<NodeStatus, NodeError> {
        self.call(Command::Status).await
    }

    /// Peers with an open connection.
    pub async fn connected_peers(&self) -> Result<Vec<PeerId>, NodeError> {
        self.call(Command::ConnectedPeers).await
    }

    /// Whether `peer` is known to be down: its last connection closed abnormally and its TCP
    /// addresses then refused connections (its process is gone). Dials to it are denied for
    /// [`crate::DOWN_FOR`] unless it connects again; what it wrote in the DHT (declarations,
    /// progress) can be disregarded meanwhile. A peer that cannot be probed (QUIC or relay
    /// only, or a host that vanished) is never marked: `false` does not mean alive.
    ///
    /// ```no_run
    /// # async fn f(node: starling_node::Node, peer: starling_node::PeerId) {
    /// if node.is_down(&peer) {
    ///     println!("{peer} crashed; not waiting for it");
    /// }
    /// # }
    /// ```
    pub fn is_down(&self, peer: &PeerId) -> bool {
        self.down.is_down(peer)
    }

    /// Every peer [`Self::is_down`] now.
    pub fn peers_down(&self) -> Vec<PeerId> {
        self.down.list()
    }

    /// The handle for opening and accepting bulk-data streams on custom protocols.
    pub fn stream_control(&self) -> crate::StreamControl {
        self.stream.clone()
    }

    /// Stores a raw entry under `key`. If the key or sub-key names this node as owner the entry
    /// is signed; if it names another owner the write is refused locally. The entry is merged into
    /// the local store and sent to the `k` peers closest to the key.
    ///
    /// Cost and semantics: one lookup of the closest peers, then the write to them; it returns
    /// once `put_quorum` of them acknowledged (one by default). The lookup has half the request
    /// timeout: past that (a closest peer that stalls without closing its connection) the write
    /// goes to the closest peers that answered by then, so a stalled peer delays a store instead
    /// of failing it. `QuorumFailed` means no peer acknowledged in time.
    pub async fn put_entry(&self, key: &str, mut entry: Entry) -> Result<PutReport, NodeError> {
        if let Some(owner) = starling_dht::required_owner(key, &entry.subkey)? {
            if owner != self.owner.public() {
                return Err(
                    starling_dht::DhtError::NotOwner(starling_dht::owner_marker(&owner)).into(),
                );
            }
            self.owner.sign_entry(key, &mut entry);
        }
        let mut record = DictionaryRecord::default();
        record.insert(entry);
        let value = record.encode();
        // Validate locally first so the caller gets the precise reason for a refusal.
        let (_, live) = self.validator.validate(key.as_bytes(), &value, now_ms())?;
        if live.is_empty() {
            return Err(starling_dht::DhtError::Expired {
                subkey: record
                    .entries()
                    .next()
                    .map(|e| e.subkey.clone())
                    .unwrap_or_default(),
            }
            .into());
        }
        let record = Record::new(RecordKey::new(&key), value);
        let started = std::time::Instant::now();
        let put = self
            .call_timeout("DHT put", self.request_timeout * 2, |tx| {
                Command::Put(record, tx)
            })
            .await;
        self.metrics
            .observe_query("put", key, put.is_ok(), started.elapsed());
        put
    }

    /// Sends raw record bytes to every connected peer **without local validation or signing**.
    ///
    /// For adversarial tests only (forged, malformed or oversized records): a well-behaved peer
    /// uses [`Self::put_entry`] or [`Self::store`]. Compiled only with the `testing` feature.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub async fn send_raw_record_unchecked(
        &self,
        key: &[u8],
        value: Vec<u8>,
    ) -> Result<PutReport, NodeError> {
        let record = Record::new(RecordKey::new(&key), value);
        self.call_timeout("raw put", self.request_timeout * 2, |tx| {
            Command::PutRawToConnected(record, tx)
        })
        .await
    }

    /// Stores a typed value under `(key, subkey)` until `expiration` (unix ms).
    pub async fn store<T: Serialize>(
        &self,
        key: &str,
        subkey: &str,
        value: &T,
        expiration: DhtTime,
    ) -> Result<PutReport, NodeError> {
        let value = encode_value(value)?;
        self.put_entry(key, Entry::new(subkey, value, expiration))
            .await
    }

    /// Looks `key` up across the swarm for its **latest** value: merges what every responding
    /// peer (and the local store) holds, and answers when the query completes, that is once
    /// the closest peers to the key have answered (or `request_timeout`), or with what it has
    /// merged by a quarter of `request_timeout` if that holds a live entry (a dead peer among
    /// the closest, whose dial hangs, does not hold the answer up). Records that fail
    /// validation are dropped; expired entries never appear. The merged record is then written
    /// back to the closest peer that answered without it, so later lookups end sooner.
    ///
    /// Cost: one lookup to the end, a few round trips on a large swarm. When any live value
    /// will do, [`Self::get_record_first`] answers at the first one.
    pub async fn get_record(&self, key: &str) -> Result<Option<DictionaryRecord>, NodeError> {
        self.lookup(key, GetMode::Latest).await
    }

    /// Looks `key` up and answers with the **first** valid record that has a live entry (the
    /// local store's, if it has one, without network traffic), ending the query there. Other
    /// peers may hold newer or more sub-keys: use [`Self::get_record`] for those.
    ///
    /// ```no_run
    /// # async fn f(node: starling_node::Node) -> Result<(), starling_node::NodeError> {
    /// if let Some(record) = node.get_record_first("experts.ffn.0").await? {
    ///     println!("{} live entries", record.entries().count());
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn get_record_first(&self, key: &str) -> Result<Option<DictionaryRecord>, NodeError> {
        self.lookup(key, GetMode::First).await
    }

    async fn lookup(
        &self,
        key: &str,
        mode: GetMode,
    ) -> Result<Option<DictionaryRecord>, NodeError> {
        self.validator.validate_key(key.as_bytes())?;
        let rk = RecordKey::new(&key);
        let started = std::time::Instant::now();
        let got = self
            .call_timeout("DHT get", self.request_timeout * 2, |tx| {
                Command::Get(rk, mode, tx)
            })
            .await;
        let label = match mode {
            GetMode::First => "get_first",
            GetMode::Latest => "get",
        };
        self.metrics
            .observe_query(label, key, got.is_ok(), started.elapsed());
        got
    }

    /// Typed [`Self::get_record`] (latest): every live entry under `key` that decodes as `T`,
    /// as `(subkey, value, expiration)`.
    pub async fn get<T: DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Vec<(String, T, DhtTime)>, NodeError> {
        Ok(self
            .get_record(key)
            .await?
            .map(|r| r.typed_entries(now_ms()))
            .unwrap_or_default())
    }

    /// Typed [`Self::get_record_first`]: the live entries of the first record found.
    pub async fn get_first<T: DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Vec<(String, T, DhtTime)>, NodeError> {
        Ok(self
            .get_record_first(key)
            .await?
            .map(|r| r.typed_entries(now_ms()))
            .unwrap_or_default())
    }

    /// What the local store holds under `key` (no network traffic).
    pub async fn get_local(&self, key: &str) -> Result<Option<DictionaryRecord>, NodeError> {
        self.call(|tx| Command::GetLocal(RecordKey::new(&key), tx))
            .await
    }

    /// Stops the swarm task and closes all connections. Other clones of this handle get
    /// [`NodeError::Closed`] afterwards.
    pub async fn shutdown(&self) {
        if let Some(f) = &self.fast {
            f.stop();
        }
        // The task answers before it returns and drops its receiver (dropping the swarm and its
        // connections on the way): wait for that too, so that `is_closed()` holds as soon as
        // `shutdown()` has returned. Both waits are bounded, for a stalled task.
        let stop = async {
            let _ = self.call(Command::Shutdown).await;
            self.tx.closed().await;
        };
        if tokio::time::timeout(SHUTDOWN_TIMEOUT, stop).await.is_err() {
            tracing::warn!("the swarm task did not stop within {SHUTDOWN_TIMEOUT:?}");
        }
    }

    /// Resolves once the node's swarm task has stopped (after [`Node::shutdown`] from any handle,
    /// or a crash); at once if it already has. Lets long operations end as soon as their own
    /// node is gone instead of waiting out their timeouts.
    ///
    /// ```no_run
    /// # async fn demo(node: starling_node::Node) {
    /// let watcher = node.clone();
    /// tokio::spawn(async move {
    ///     watcher.closed().await;
    ///     eprintln!("node stopped");
    /// });
    /// node.shutdown().await;
    /// # }
    /// ```
    pub async fn closed(&self) {
        self.tx.closed().await
    }

    /// Whether the node's swarm task has stopped.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// The fast lane's TCP port, if this node listens for lanes (the port of the first of
    /// [`Self::fast_lane_addrs`]).
    pub fn fast_lane_port(&self) -> Option<u16> {
        self.fast.as_ref().and_then(|f| f.port())
    }

    /// Where the fast lane listens: one address per TCP listen IP, where an unspecified IP
    /// (`0.0.0.0`, `::`) means every interface. Empty in client mode or with the lane disabled.
    pub fn fast_lane_addrs(&self) -> Vec<std::net::SocketAddr> {
        self.fast
            .as_ref()
            .map(|f| f.addrs().to_vec())
            .unwrap_or_default()
    }

    /// Takes inbound fast lanes for `protocol`: each item is an authenticated peer and its
    /// [`FastStream`]. Fails in client mode, with the fast lane disabled, or when `protocol`
    /// already has a handler.
    ///
    /// ```no_run
    /// # async fn demo(node: starling_node::Node) -> Result<(), Box<dyn std::error::Error>> {
    /// use futures::{AsyncReadExt, AsyncWriteExt};
    /// use starling_node::StreamProtocol;
    /// const ECHO: StreamProtocol = StreamProtocol::new("/example/echo/1");
    /// let mut incoming = node.accept_fast(ECHO)?;
    /// while let Some((_peer, mut lane)) = incoming.recv().await {
    ///     let mut buf = vec![0u8; 1024];
    ///     let n = lane.read(&mut buf).await?;
    ///     lane.write_all(&buf[..n]).await?;
    ///     lane.close().await?; // a dropped lane reads as truncated on the other side
    /// }
    /// # Ok(()) }
    /// ```
    pub fn accept_fast(&self, protocol: StreamProtocol) -> Result<IncomingFast, NodeError> {
        match &self.fast {
            Some(f) => f.accept(&protocol),
            None => Err(NodeError::FastLane("the fast lane is disabled".into())),
        }
    }

    /// Opens a fast lane to `peer` for `protocol` (see [`crate::fastlane`]). `peer` must be
    /// connected directly (not through a relay) and accept lanes for `protocol`; otherwise
    /// this fails within the request timeout, and callers should fall back to
    /// [`Self::stream_control`].
    ///
    /// ```no_run
    /// # async fn demo(node: starling_node::Node, peer: starling_node::PeerId) -> Result<(), Box<dyn std::error::Error>> {
    /// use futures::{AsyncReadExt, AsyncWriteExt};
    /// use starling_node::StreamProtocol;
    /// let mut lane = node.open_fast(peer, StreamProtocol::new("/example/echo/1")).await?;
    /// lane.write_all(b"hello").await?;
    /// lane.close().await?; // flushes, then ends our direction
    /// let mut echo = Vec::new();
    /// lane.read_to_end(&mut echo).await?;
    /// # Ok(()) }
    /// ```
    pub async fn open_fast(
        &self,
        peer: PeerId,
        protocol: StreamProtocol,
    ) -> Result<FastStream, NodeError> {
        let Some(fast) = &self.fast else {
            return Err(NodeError::FastLane("the fast lane is disabled".into()));
        };
        let ip = self
            .call(|tx| Command::PeerIp(peer, tx))
            .await?
            .ok_or_else(|| NodeError::FastLane(format!("no direct connection to {peer}")))?;
        fast.open(self.stream.clone(), peer, ip, &protocol).await
    }
}

/// The span a node's tasks run in: `node{peer=<last 6 characters of the peer id>}`, enough to
/// tell apart the nodes of one process (a [`LocalCluster`](crate::cluster::LocalCluster), a
/// test). At error level so that it tags every event, whatever the filter lets through.
fn node_span(peer: &PeerId) -> tracing::Span {
    let id = peer.to_base58();
    let short = &id[id.len().saturating_sub(6)..];
    tracing::error_span!("node", peer = %short)
}

/// The configured identity, the one in the identity file (created when absent), or a fresh one.
fn identity(cfg: &NodeConfig) -> Result<Keypair, NodeError> {
    Ok(match (&cfg.identity, &cfg.identity_file) {
        (Some(k), _) => k.clone(),
        (None, Some(path)) => load_or_create_identity(path)?,
        (None, None) => Keypair::generate_ed25519(),
    })
}

/// The fast lane as configured: none when disabled, dial-only in client mode, else listening
/// on every IP of the configured TCP listen addresses `listen` (all interfaces for `0.0.0.0`,
/// and when there is none).
async fn start_fast_lane(
    cfg: &NodeConfig,
    listen: &[Multiaddr],
    stream: crate::StreamControl,
    peer_ip: PeerIpLookup,
) -> Result<Option<Arc<FastLane>>, NodeError> {
    if !cfg.fast_lane {
        return Ok(None);
    }
    let read_delay = cfg.simulated_rtt.map(|rtt| rtt / 2);
    if cfg.client_mode {
        return Ok(Some(FastLane::dial_only(cfg.request_timeout, read_delay)));
    }
    let ips = lane_ips(listen.iter().filter_map(transport::tcp_ip));
    let lane = FastLane::listen(
        &ips,
        cfg.fast_lane_port,
        cfg.request_timeout,
        stream,
        peer_ip,
        read_delay,
    )
    .await?;
    Ok(Some(lane))
}

/// How the fast lane asks the swarm task where a peer connects from. Holds the command channel
/// weakly: the lane never keeps a stopped node's channel open.
fn peer_ip_lookup(tx: &mpsc::Sender<Command>) -> PeerIpLookup {
    let tx = tx.downgrade();
    Arc::new(move |peer| {
        let tx = tx.clone();
        Box::pin(async move {
            let tx = tx.upgrade()?;
            let (reply, answer) = oneshot::channel();
            tx.send(Command::PeerIp(peer, reply)).await.ok()?;
            answer.await.ok().flatten()
        })
    })
}

#[cfg(test)]
mod tests;
