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
    /// Timeout of one Kademlia request to one peer inside a query. A peer that died without
    /// its connection closing (a power cut, a frozen process) holds a lookup that must hear
    /// from it for this long, not for the whole query (libp2p's default is 10 s). Default 3 s.
    pub dht_peer_timeout: Duration,
    /// How often each bootstrap address is tried before giving up. Default 5.
    pub bootstrap_attempts: u32,
    /// Pause between bootstrap rounds (doubles each round). Default 100 ms: with 5 attempts
    /// a join gives up after 1.5 s of pauses, and a peer started together with its bootstrap
    /// peer (a lab launching its machines at once) is in within 100-300 ms of it listening.
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
    /// How many connections the node keeps open (its connection manager).
    pub connections: ConnectionLimits,
    /// How often Kademlia refreshes the routing table (a lookup of our own id, then one of a
    /// random id in every bucket farther out: a few hundred requests, many on new connections,
    /// in a swarm of a thousand). `None`: never; the table then changes only through traffic.
    /// Default 5 minutes (libp2p's). A real node pays this alone; a thousand simulated peers
    /// sharing two cores pay it together, which is why `starling bench dht` can stretch it.
    pub routing_refresh_interval: Option<Duration>,
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
    /// Addresses this node is known to be reachable at (a public IP, a forwarded port). They are
    /// announced as confirmed at start, without waiting for autonat; a relay server needs at
    /// least one confirmed address before it hands out reservations.
    pub external_addrs: Vec<Multiaddr>,
    /// Serve as a circuit relay (v2) for peers behind NATs, within these limits. `None`: no.
    pub relay_server: Option<RelayServerConfig>,
    /// Reachability detection (autonat) and what a node behind a NAT does about it.
    pub nat: NatConfig,
    /// **A simulation for benches** (see [`crate::simdelay`]): every byte arriving on this
    /// node's TCP connections, libp2p's and the fast lane's, is held back half this long, so
    /// a round trip between two such nodes gains this much. QUIC is off while it is set.
    /// `None` (the default): no delay. Real links need none of this.
    pub simulated_rtt: Option<Duration>,
}

/// The connection manager's bounds. Kademlia talks to whichever peers a lookup leads to and
/// libp2p keeps each connection until it has been idle for
/// [`NodeConfig::idle_connection_timeout`], so in a large swarm a busy node drifts towards a
/// connection to everyone (about 134 per peer with 177 peers up, measured), one file descriptor
/// each. The manager keeps the count bounded, in the manner of go-libp2p's `connmgr` (which
/// hivemind's daemon runs): when more than `high_water` connections are open it closes whole
/// peers' connections until `low_water` remain, least valuable first: peers outside the
/// Kademlia routing table before peers in it, and among those the one used longest ago (its
/// newest connection, or the last stream opened to or from it through
/// [`Node::stream_control`](crate::Node::stream_control)). Never closed: peers used within
/// `grace`, relays this node holds a reservation on, and peers holding a reservation or
/// circuit on this node's relay server. Above `max_established` libp2p refuses new connections
/// outright (a ceiling for bursts of new peers, all still in their grace period).
///
/// Protection comes from use: a stream that stays open longer than `grace` with nothing new
/// opened to that peer may lose its connection when the node is over its high-water mark.
/// Groups of averaging peers open streams every round, so they stay protected while they work.
///
/// ```
/// use starling_node::{ConnectionLimits, NodeConfig};
/// let cfg = NodeConfig::default().with_connections(ConnectionLimits::with_high_water(48));
/// assert_eq!(cfg.connections.low_water, 24);
/// assert!(cfg.connections.max_established.unwrap() > 48);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections left open after pruning.
    pub low_water: usize,
    /// Pruning starts when more than this many connections are open.
    pub high_water: usize,
    /// A peer used within this long is never pruned (a new connection counts as a use).
    pub grace: Duration,
    /// Established connections at most (inbound and outbound); `None`: no ceiling.
    pub max_established: Option<u32>,
}

impl ConnectionLimits {
    /// Limits around a high-water mark: low water at half of it, a ceiling at twice it, a 20 s
    /// grace period.
    pub fn with_high_water(high_water: usize) -> Self {
        let high_water = high_water.max(2);
        ConnectionLimits {
            low_water: high_water / 2,
            high_water,
            grace: Duration::from_secs(20),
            max_established: u32::try_from(high_water.saturating_mul(2)).ok(),
        }
    }

    /// No pruning and no ceiling.
    pub fn unlimited() -> Self {
        ConnectionLimits {
            low_water: usize::MAX,
            high_water: usize::MAX,
            grace: Duration::from_secs(20),
            max_established: None,
        }
    }
}

impl Default for ConnectionLimits {
    /// High water 128, low water 64, a ceiling of 256, 20 s grace: room for a routing table of a
    /// thousand-peer swarm and the groups a node averages with.
    fn default() -> Self {
        ConnectionLimits::with_high_water(128)
    }
}

/// How a node learns whether others can dial it (libp2p autonat v1), and what it does when they
/// cannot: it switches Kademlia to client mode, reserves slots on relays it is connected to and
/// lets dcutr turn relayed connections into direct ones (hole punching).
///
/// ```
/// use starling_node::{NatConfig, NodeConfig};
/// let lab = NodeConfig::default().with_nat(NatConfig { private_ips: true, ..NatConfig::default() });
/// assert!(lab.nat.auto_relay);
/// ```
#[derive(Clone, Debug)]
pub struct NatConfig {
    /// Delay before the first probe: time to connect to peers that can run it.
    pub probe_delay: Duration,
    /// Pause between probes while the verdict is missing or not yet confident.
    pub probe_interval: Duration,
    /// Pause between probes once the verdict is confident.
    pub refresh_interval: Duration,
    /// How long a probe may take. A dial-back into a NAT that drops unsolicited packets fails
    /// only at the transport's 10 s connection timeout, so keep this well above that.
    pub probe_timeout: Duration,
    /// Let autonat ask, and answer, peers seen at private IP addresses (10/8, 172.16/12,
    /// 192.168/16, ...). Turn on where the network between peers is itself private (a campus,
    /// a VPC, test namespaces). Off by default: on the internet, a neighbour on the same LAN
    /// reaching us says nothing about whether the rest of the swarm can.
    pub private_ips: bool,
    /// Reserve relay slots when autonat finds this node private, so that it is reachable at
    /// `/p2p-circuit` addresses.
    pub auto_relay: bool,
    /// At most this many relay reservations at once.
    pub max_relays: usize,
    /// After a reservation is refused or lost, how long before that relay is tried again.
    pub relay_retry: Duration,
}

impl Default for NatConfig {
    fn default() -> Self {
        NatConfig {
            probe_delay: Duration::from_secs(5),
            probe_interval: Duration::from_secs(30),
            refresh_interval: Duration::from_secs(15 * 60),
            probe_timeout: Duration::from_secs(30),
            private_ips: false,
            auto_relay: true,
            max_relays: 2,
            relay_retry: Duration::from_secs(30),
        }
    }
}

/// Limits of a circuit relay (v2) server ([`NodeConfig::relay_server`]). Reservations are also
/// rate-limited per peer and per IP with libp2p's defaults. A relayed connection carries
/// control traffic and hole punching, not bulk data: keep the circuit limits small.
#[derive(Clone, Debug)]
pub struct RelayServerConfig {
    /// Reservations held at once, over all peers.
    pub max_reservations: usize,
    /// Reservations one peer may hold at once.
    pub max_reservations_per_peer: usize,
    /// How long a reservation lasts before the client must renew it.
    pub reservation_duration: Duration,
    /// Circuits relayed at once, over all peers.
    pub max_circuits: usize,
    /// Circuits one peer may have relayed at once.
    pub max_circuits_per_peer: usize,
    /// A circuit is closed after this long.
    pub max_circuit_duration: Duration,
    /// A circuit is closed after this many bytes (both directions together).
    pub max_circuit_bytes: u64,
}

impl Default for RelayServerConfig {
    fn default() -> Self {
        RelayServerConfig {
            max_reservations: 128,
            max_reservations_per_peer: 4,
            reservation_duration: Duration::from_secs(60 * 60),
            max_circuits: 16,
            max_circuits_per_peer: 4,
            max_circuit_duration: Duration::from_secs(2 * 60),
            max_circuit_bytes: 1 << 20,
        }
    }
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
            dht_peer_timeout: Duration::from_secs(3),
            bootstrap_attempts: 5,
            bootstrap_backoff: Duration::from_millis(100),
            replication_factor: 20,
            put_quorum: 1,
            replication_interval: Some(Duration::from_secs(600)),
            idle_connection_timeout: Duration::from_secs(120),
            connections: ConnectionLimits::default(),
            routing_refresh_interval: Some(Duration::from_secs(300)),
            kad_protocol: DEFAULT_KAD_PROTOCOL.to_string(),
            command_queue: 1024,
            fast_lane: true,
            fast_lane_port: 0,
            external_addrs: Vec::new(),
            relay_server: None,
            nat: NatConfig::default(),
            simulated_rtt: None,
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

    /// Sets the connection manager's bounds.
    pub fn with_connections(mut self, limits: ConnectionLimits) -> Self {
        self.connections = limits;
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

    /// Serves as a circuit relay for peers behind NATs (see [`RelayServerConfig`]).
    pub fn with_relay_server(mut self, limits: RelayServerConfig) -> Self {
        self.relay_server = Some(limits);
        self
    }

    /// Adds an address this node is known to be reachable at.
    pub fn with_external_addr(mut self, addr: Multiaddr) -> Self {
        self.external_addrs.push(addr);
        self
    }

    /// Sets reachability detection and NAT traversal.
    pub fn with_nat(mut self, nat: NatConfig) -> Self {
        self.nat = nat;
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
        // QUIC: not in a private swarm (pnet covers TCP only), nor with a simulated RTT (UDP
        // would pass around the delay).
        if self.swarm_key.is_none() && self.simulated_rtt.is_none() {
            v.push(
                "/ip4/0.0.0.0/udp/0/quic-v1"
                    .parse()
                    .expect("valid multiaddr"),
            );
        }
        v
    }
}
