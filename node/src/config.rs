//! [`NodeConfig`]: everything a node is started with, with defaults and builder methods.

use std::path::PathBuf;
use std::time::Duration;

use libp2p::{identity::Keypair, Multiaddr};
use starling_dht::DhtLimits;

use crate::SwarmKey;

/// The Kademlia protocol name of Starling swarms. A separate name from the public IPFS DHT keeps
/// the two from mixing.
pub const DEFAULT_KAD_PROTOCOL: &str = "/starling/kad/1.0.0";

/// How a node is set up. Build with [`NodeConfig::default`] and the builder methods.
///
/// ```
/// use std::time::Duration;
/// use starling_node::NodeConfig;
/// let cfg = NodeConfig::default()
///     .listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap())
///     .with_request_timeout(Duration::from_secs(5));
/// assert_eq!(cfg.listen.len(), 1);
/// ```
#[derive(Clone)]
pub struct NodeConfig {
    /// The identity; `None` generates an ephemeral one unless `identity_file` is set.
    pub identity: Option<Keypair>,
    /// A key file to load the identity from (created with 0600 permissions when absent).
    pub identity_file: Option<PathBuf>,
    /// Addresses to listen on. Empty in client mode.
    pub listen: Vec<Multiaddr>,
    /// Peers to join through. Each address should end in `/p2p/<peer id>`.
    pub bootstrap: Vec<Multiaddr>,
    /// The private swarm's key; `None` runs a public swarm (TCP and QUIC).
    pub swarm_key: Option<SwarmKey>,
    /// Accept no inbound connections and run Kademlia in client mode.
    pub client_mode: bool,
    /// Bounds on records accepted and held.
    pub dht_limits: DhtLimits,
    /// Timeout of one dial, and of each DHT query.
    pub request_timeout: Duration,
    /// How often each bootstrap address is tried before giving up.
    pub bootstrap_attempts: u32,
    /// Pause between bootstrap rounds (doubles each round).
    pub bootstrap_backoff: Duration,
    /// Kademlia replication factor (k): how many peers store each record.
    pub replication_factor: usize,
    /// How many peers must acknowledge a PUT for it to count as a success.
    pub put_quorum: usize,
    /// How often held records are re-sent to the peers closest to them (keeps records alive
    /// across churn). `None` disables replication.
    pub replication_interval: Option<Duration>,
    /// How long an idle connection stays open.
    pub idle_connection_timeout: Duration,
    /// The Kademlia protocol name; peers with different names do not talk.
    pub kad_protocol: String,
    /// Capacity of the command channel between handles and the swarm task.
    pub command_queue: usize,
    /// Run the fast lane (see [`crate::fastlane`]): a TCP listener for direct encrypted bulk
    /// connections, and dialing other peers' lanes. Client-mode nodes only dial.
    pub fast_lane: bool,
    /// The fast lane's TCP port (0: chosen by the OS). It listens on every IP of the TCP listen
    /// addresses (all interfaces for `0.0.0.0`, the default), on this one port where it can.
    pub fast_lane_port: u16,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            identity: None,
            identity_file: None,
            listen: Vec::new(),
            bootstrap: Vec::new(),
            swarm_key: None,
            client_mode: false,
            dht_limits: DhtLimits::default(),
            request_timeout: Duration::from_secs(10),
            bootstrap_attempts: 3,
            bootstrap_backoff: Duration::from_millis(500),
            replication_factor: 20,
            put_quorum: 1,
            replication_interval: Some(Duration::from_secs(600)),
            idle_connection_timeout: Duration::from_secs(120),
            kad_protocol: DEFAULT_KAD_PROTOCOL.to_string(),
            command_queue: 1024,
            fast_lane: true,
            fast_lane_port: 0,
        }
    }
}

impl NodeConfig {
    /// Adds a listen address.
    pub fn listen_on(mut self, addr: Multiaddr) -> Self {
        self.listen.push(addr);
        self
    }

    /// Adds a bootstrap address.
    pub fn bootstrap_from(mut self, addr: Multiaddr) -> Self {
        self.bootstrap.push(addr);
        self
    }

    /// Joins (or forms) the private swarm protected by `key`.
    pub fn with_swarm_key(mut self, key: SwarmKey) -> Self {
        self.swarm_key = Some(key);
        self
    }

    /// Uses this identity.
    pub fn with_identity(mut self, key: Keypair) -> Self {
        self.identity = Some(key);
        self
    }

    /// Loads (or creates) the identity from this file.
    pub fn with_identity_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.identity_file = Some(path.into());
        self
    }

    /// Client mode: no inbound connections, Kademlia client.
    pub fn client(mut self, client: bool) -> Self {
        self.client_mode = client;
        self
    }

    /// Sets the dial / query timeout.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sets the DHT bounds.
    pub fn with_dht_limits(mut self, limits: DhtLimits) -> Self {
        self.dht_limits = limits;
        self
    }

    /// Listen addresses to use: the configured ones, or TCP (and QUIC in public swarms) on all
    /// interfaces with OS-chosen ports; none in client mode.
    pub(crate) fn effective_listen(&self) -> Vec<Multiaddr> {
        if self.client_mode {
            return Vec::new();
        }
        if !self.listen.is_empty() {
            return self.listen.clone();
        }
        let mut v: Vec<Multiaddr> = vec!["/ip4/0.0.0.0/tcp/0".parse().expect("valid multiaddr")];
        if self.swarm_key.is_none() {
            v.push(
                "/ip4/0.0.0.0/udp/0/quic-v1"
                    .parse()
                    .expect("valid multiaddr"),
            );
        }
        v
    }
}
