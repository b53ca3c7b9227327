//! The protocols every node runs, composed into one `NetworkBehaviour`, and how each is set
//! up from a [`NodeConfig`].
//!
//! Kademlia departs from libp2p's defaults on purpose: records are filtered
//! (`StoreInserts::FilterBoth`, our store validates and merges every inbound PUT), never cached
//! on the query path, never republished by age (expiration is per sub-key, inside the value),
//! and a packet may hold the largest record we accept plus [`KAD_PACKET_OVERHEAD`].

use std::num::NonZeroUsize;
use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::kad::{self, StoreInserts};
use libp2p::swarm::{behaviour::toggle::Toggle, NetworkBehaviour};
use libp2p::{autonat, connection_limits, dcutr, identify, ping, relay, StreamProtocol};
use starling_dht::DhtStore;

use crate::{NatConfig, NodeConfig, NodeError, RelayServerConfig};

/// Bytes a Kademlia packet may carry beyond the largest record: room for the closer-peer lists
/// and the message envelope.
const KAD_PACKET_OVERHEAD: usize = 64 * 1024;
/// Pause between pings on a connection (libp2p's default is 15 s; see `build`).
const PING_INTERVAL: Duration = Duration::from_secs(120);
/// Pause between periodic identify exchanges on a connection.
const IDENTIFY_INTERVAL: Duration = Duration::from_secs(300);

/// The protocols every Starling node runs, composed into one behaviour.
#[derive(NetworkBehaviour)]
pub(crate) struct Behaviour {
    /// The ceiling on established connections ([`crate::ConnectionLimits::max_established`]);
    /// pruning below it is the swarm task's (see `node::connections`).
    pub limits: connection_limits::Behaviour,
    /// Denies dials to peers known to be down ([`crate::down`]).
    pub down: crate::down::Behaviour,
    pub kad: kad::Behaviour<DhtStore>,
    pub identify: identify::Behaviour,
    pub ping: ping::Behaviour,
    pub autonat: autonat::Behaviour,
    pub relay_client: relay::client::Behaviour,
    /// The circuit relay server, on nodes configured as relays.
    pub relay_server: Toggle<relay::Behaviour>,
    pub dcutr: dcutr::Behaviour,
    pub stream: libp2p_stream::Behaviour,
}

/// The behaviour for identity `key`: Kademlia over our validating [`DhtStore`] (inbound PUTs
/// filtered, no caching, no republishing, our own record-size bound), identify, ping, autonat,
/// the relay client the swarm builder made, the relay server if configured, dcutr and
/// `libp2p-stream`.
pub(crate) fn build(
    key: &Keypair,
    relay_client: relay::client::Behaviour,
    cfg: &NodeConfig,
) -> Result<Behaviour, NodeError> {
    let peer_id = key.public().to_peer_id();
    let protocol = StreamProtocol::try_from_owned(cfg.kad_protocol.clone())
        .map_err(|e| NodeError::Config(format!("kad protocol name: {e}")))?;
    let mut kad_cfg = kad::Config::new(protocol);
    kad_cfg
        .set_record_filtering(StoreInserts::FilterBoth)
        .set_query_timeout(cfg.request_timeout)
        .set_substreams_timeout(cfg.dht_peer_timeout.min(cfg.request_timeout))
        .set_max_packet_size(cfg.dht_limits.max_record_bytes + KAD_PACKET_OVERHEAD)
        .set_record_ttl(None)
        .set_publication_interval(None)
        .set_provider_publication_interval(None)
        .set_replication_interval(cfg.replication_interval)
        .set_periodic_bootstrap_interval(cfg.routing_refresh_interval)
        // The closest peer that answered a lookup without the record gets it written back
        // (`Queries::finish_get`), so later lookups end sooner.
        .set_caching(kad::Caching::Enabled { max_peers: 1 });
    if let Some(k) = NonZeroUsize::new(cfg.replication_factor) {
        kad_cfg.set_replication_factor(k);
    }
    let store = DhtStore::new(cfg.dht_limits.clone());
    let mut kad = kad::Behaviour::with_config(peer_id, store, kad_cfg);
    kad.set_mode(Some(if cfg.client_mode {
        kad::Mode::Client
    } else {
        kad::Mode::Server
    }));

    let identify = identify::Behaviour::new(
        identify::Config::new("/starling/1.0.0".into(), key.public())
            .with_agent_version(format!("starling/{}", env!("CARGO_PKG_VERSION")))
            // Identify runs on every new connection and pushes address changes; the periodic
            // re-identify only repeats what the peer already said.
            .with_interval(IDENTIFY_INTERVAL),
    );
    let limits = connection_limits::ConnectionLimits::default()
        .with_max_established(cfg.connections.max_established);
    Ok(Behaviour {
        limits: connection_limits::Behaviour::new(limits),
        down: crate::down::Behaviour::new(crate::DownPeers::default()),
        kad,
        identify,
        // Every connection pings both ways; at libp2p's 15 s that was 80 % of an idle swarm's
        // CPU (2.3 of 2.9 ms per second per peer at 128 peers, each connected to ~125), which
        // a thousand peers on two cores cannot pay. Pings only feed the RTT metrics here.
        ping: ping::Behaviour::new(ping::Config::new().with_interval(PING_INTERVAL)),
        autonat: autonat::Behaviour::new(peer_id, autonat_config(&cfg.nat)),
        relay_client,
        relay_server: cfg
            .relay_server
            .as_ref()
            .map(|limits| relay::Behaviour::new(peer_id, relay_config(limits)))
            .into(),
        dcutr: dcutr::Behaviour::new(peer_id),
        stream: libp2p_stream::Behaviour::new(),
    })
}

/// Autonat (v1) as [`NatConfig`] says; the rest of libp2p's defaults (three agreeing probes for
/// a confident verdict, a server reused at most every 90 s, at most 30 dial-backs a second).
fn autonat_config(nat: &NatConfig) -> autonat::Config {
    autonat::Config {
        timeout: nat.probe_timeout,
        boot_delay: nat.probe_delay,
        retry_interval: nat.probe_interval,
        refresh_interval: nat.refresh_interval,
        only_global_ips: !nat.private_ips,
        ..autonat::Config::default()
    }
}

/// The relay server's limits, with libp2p's per-peer and per-IP reservation and circuit rate
/// limiters.
fn relay_config(limits: &RelayServerConfig) -> relay::Config {
    relay::Config {
        max_reservations: limits.max_reservations,
        max_reservations_per_peer: limits.max_reservations_per_peer,
        reservation_duration: limits.reservation_duration,
        max_circuits: limits.max_circuits,
        max_circuits_per_peer: limits.max_circuits_per_peer,
        max_circuit_duration: limits.max_circuit_duration,
        max_circuit_bytes: limits.max_circuit_bytes,
        ..relay::Config::default()
    }
}
