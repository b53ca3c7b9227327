//! NAT traversal inside the swarm task, and the [`NatEvent`]s that report it.
//!
//! The mechanisms are libp2p's: autonat (v1) decides whether others can dial us, circuit relay
//! v2 makes a private node reachable at `/p2p-circuit` addresses, and dcutr turns a relayed
//! connection into a direct one by simultaneous dials (hole punching). What lives here is only
//! the policy that joins them:
//!
//! - **private** (autonat's dial-backs fail): Kademlia switches to client mode, so the node
//!   never enters routing tables at an address nobody can dial, and the node reserves slots
//!   on up to [`NatConfig::max_relays`] relays: connected peers that announce the relay hop
//!   protocol in identify. Reservations lost or refused are retried after
//!   [`NatConfig::relay_retry`], from the swarm task's periodic sweep ([`Nat::maintain`]);
//! - **public**: Kademlia server mode, relay reservations dropped;
//! - hole punches start on their own when a peer reaches us through a relay; their outcomes,
//!   like the verdicts and reservations above, go to [`Node::nat_events`](super::Node::nat_events)
//!   subscribers.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libp2p::core::transport::ListenerId;
use libp2p::core::ConnectedPoint;
use libp2p::kad;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::ConnectionId;
use libp2p::{autonat, dcutr, identify, relay, Multiaddr, PeerId, Swarm};
use tokio::sync::broadcast;

use super::Reachability;
use crate::behaviour::Behaviour;
use crate::{NatConfig, NodeConfig};
use starling_dht::lock::lock;

/// Relay candidates remembered at most (peers announcing the hop protocol).
const MAX_RELAY_CANDIDATES: usize = 32;

/// A reservation the relay has not answered within this long is given up.
const RESERVATION_TIMEOUT: Duration = Duration::from_secs(30);

/// Subscribers may fall this many events behind before they miss some.
const EVENT_CAPACITY: usize = 64;

/// What a node learned or did about NAT traversal; see [`Node::nat_events`](super::Node::nat_events).
/// `Display` gives one concise line per event, as `starling node` prints them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NatEvent {
    /// Autonat changed its verdict on whether others can dial this node.
    Reachability(Reachability),
    /// A relay accepted this node's reservation.
    RelayReserved {
        /// The relay.
        relay: PeerId,
        /// Time from the node's start to the acceptance.
        since_start: Duration,
        /// Time from autonat's `Private` verdict to the acceptance.
        since_private: Duration,
    },
    /// This node can be dialed through a relay at this address (ends in `/p2p/<own id>`).
    Reachable(Multiaddr),
    /// A reservation was refused, or ended (connection to the relay lost, node went public).
    RelayLost {
        /// The relay.
        relay: PeerId,
        /// Why, as libp2p put it.
        reason: String,
    },
    /// A hole punch (dcutr) with a peer connected through a relay ended.
    HolePunch {
        /// The other peer.
        peer: PeerId,
        /// The direct connection's remote address, or why no direct connection was made.
        result: Result<Multiaddr, String>,
    },
}

impl fmt::Display for NatEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NatEvent::Reachability(r) => write!(f, "reachability {r:?}"),
            NatEvent::RelayReserved {
                relay,
                since_start,
                since_private,
            } => write!(
                f,
                "relay reservation accepted by {relay} ({} ms after start, {} ms after autonat found this node private)",
                since_start.as_millis(),
                since_private.as_millis()
            ),
            NatEvent::Reachable(addr) => write!(f, "reachable through a relay at {addr}"),
            NatEvent::RelayLost { relay, reason } => write!(f, "relay {relay} lost: {reason}"),
            NatEvent::HolePunch {
                peer,
                result: Ok(addr),
            } => write!(f, "hole punch with {peer} succeeded: direct connection to {addr}"),
            NatEvent::HolePunch {
                peer,
                result: Err(e),
            } => write!(f, "hole punch with {peer} failed: {e}"),
        }
    }
}

/// Where a node's [`NatEvent`]s go. The first subscriber also gets the events since the node
/// started (up to [`EVENT_CAPACITY`] of them), so that a verdict reached while
/// [`Node::start`](super::Node::start) was still joining is not lost; later subscribers get
/// events from the moment they subscribe.
pub(super) struct NatEvents {
    tx: broadcast::Sender<NatEvent>,
    first: Mutex<Option<broadcast::Receiver<NatEvent>>>,
}

impl NatEvents {
    pub(super) fn new() -> Arc<NatEvents> {
        let (tx, rx) = broadcast::channel(EVENT_CAPACITY);
        Arc::new(NatEvents {
            tx,
            first: Mutex::new(Some(rx)),
        })
    }

    /// The sending side, for the swarm task.
    pub(super) fn sender(&self) -> broadcast::Sender<NatEvent> {
        self.tx.clone()
    }

    /// A receiver: the one made at start for the first caller, a fresh one after.
    pub(super) fn subscribe(&self) -> broadcast::Receiver<NatEvent> {
        lock(&self.first)
            .take()
            .unwrap_or_else(|| self.tx.subscribe())
    }
}

/// One relay reservation (a listener on a `/p2p-circuit` address).
struct Reservation {
    relay: PeerId,
    requested: Instant,
    accepted: bool,
    /// The circuit address last reported for it.
    announced: Option<Multiaddr>,
}

/// The swarm task's NAT state.
pub(super) struct Nat {
    cfg: NatConfig,
    reachability: Reachability,
    started: Instant,
    private_since: Option<Instant>,
    events: broadcast::Sender<NatEvent>,
    /// Peers that announce the hop protocol, with an address to reach them at.
    relays: HashMap<PeerId, Multiaddr>,
    reservations: HashMap<ListenerId, Reservation>,
    /// Relays refused or lost recently, and when they may be tried again.
    retry_at: HashMap<PeerId, Instant>,
    /// Remote addresses of open direct connections, and whether we dialed them.
    direct: HashMap<ConnectionId, (Multiaddr, bool)>,
}

impl Nat {
    /// The state of a node started with `cfg`; its events go to `events`.
    pub(super) fn new(cfg: &NodeConfig, events: broadcast::Sender<NatEvent>) -> Self {
        let reachability = if cfg.client_mode {
            Reachability::Client
        } else if !cfg.external_addrs.is_empty() {
            Reachability::Public
        } else {
            Reachability::Unknown
        };
        Nat {
            cfg: cfg.nat.clone(),
            reachability,
            started: Instant::now(),
            private_since: None,
            events,
            relays: HashMap::new(),
            reservations: HashMap::new(),
            retry_at: HashMap::new(),
            direct: HashMap::new(),
        }
    }

    /// Relays this node holds (or has asked for) a reservation on: their connections carry
    /// this node's reachability and must stay open.
    pub(super) fn reserved_relays(&self) -> impl Iterator<Item = PeerId> + '_ {
        self.reservations.values().map(|r| r.relay)
    }

    /// The current verdict.
    pub(super) fn reachability(&self) -> Reachability {
        self.reachability
    }

    fn emit(&self, event: NatEvent) {
        tracing::info!("{event}");
        // No subscriber is not an error.
        let _ = self.events.send(event);
    }

    /// Autonat changed its verdict: switch Kademlia's mode and reserve or drop relay slots.
    pub(super) fn on_autonat(&mut self, swarm: &mut Swarm<Behaviour>, new: autonat::NatStatus) {
        if self.reachability == Reachability::Client {
            return;
        }
        let now = match new {
            autonat::NatStatus::Public(_) => Reachability::Public,
            autonat::NatStatus::Private => Reachability::Private,
            autonat::NatStatus::Unknown => Reachability::Unknown,
        };
        if now == self.reachability {
            return;
        }
        self.reachability = now;
        self.emit(NatEvent::Reachability(now));
        match now {
            Reachability::Private => {
                self.private_since = Some(Instant::now());
                swarm.behaviour_mut().kad.set_mode(Some(kad::Mode::Client));
                self.maintain(swarm);
            }
            Reachability::Public => {
                self.private_since = None;
                swarm.behaviour_mut().kad.set_mode(Some(kad::Mode::Server));
                for id in self.reservations.keys() {
                    swarm.remove_listener(*id);
                }
            }
            Reachability::Unknown | Reachability::Client => {}
        }
    }

    /// A peer identified itself: remember it as a relay if it runs the hop protocol.
    pub(super) fn on_identify(
        &mut self,
        swarm: &mut Swarm<Behaviour>,
        peer: PeerId,
        connection: ConnectionId,
        info: &identify::Info,
    ) {
        if !info.protocols.contains(&relay::HOP_PROTOCOL_NAME) {
            self.relays.remove(&peer);
            return;
        }
        if self.relays.len() >= MAX_RELAY_CANDIDATES && !self.relays.contains_key(&peer) {
            return;
        }
        // The address we dialed it at, else the first direct address it announces.
        let addr = match self.direct.get(&connection) {
            Some((addr, true)) => Some(addr.clone()),
            _ => info.listen_addrs.iter().find(|a| !is_relayed(a)).cloned(),
        };
        let Some(mut addr) = addr else { return };
        if !matches!(addr.iter().last(), Some(Protocol::P2p(_))) {
            addr.push(Protocol::P2p(peer));
        }
        self.relays.insert(peer, addr);
        self.maintain(swarm);
    }

    /// Tracks direct connections (their addresses go into hole-punch reports).
    pub(super) fn on_connection_established(
        &mut self,
        connection: ConnectionId,
        endpoint: &ConnectedPoint,
    ) {
        let addr = endpoint.get_remote_address();
        if !is_relayed(addr) {
            self.direct
                .insert(connection, (addr.clone(), endpoint.is_dialer()));
        }
    }

    /// The remote address of an open direct connection.
    pub(super) fn remote_addr(&self, connection: ConnectionId) -> Option<&Multiaddr> {
        self.direct.get(&connection).map(|(addr, _)| addr)
    }

    /// Forgets a closed connection.
    pub(super) fn on_connection_closed(&mut self, connection: ConnectionId) {
        self.direct.remove(&connection);
    }

    /// A listener got an address: a relayed one means we are reachable through that relay.
    pub(super) fn on_new_listen_addr(
        &mut self,
        listener: ListenerId,
        addr: &Multiaddr,
        me: PeerId,
    ) {
        let Some(r) = self.reservations.get_mut(&listener) else {
            return;
        };
        let mut addr = addr.clone();
        if addr.iter().last() != Some(Protocol::P2p(me)) {
            addr.push(Protocol::P2p(me));
        }
        // libp2p reports the address once with and once without our id.
        if is_relayed(&addr) && r.announced.as_ref() != Some(&addr) {
            r.announced = Some(addr.clone());
            self.emit(NatEvent::Reachable(addr));
        }
    }

    /// A listener closed: if it was a reservation, the relay is lost (and tried again later).
    pub(super) fn on_listener_closed(&mut self, listener: ListenerId, reason: String) {
        if let Some(r) = self.reservations.remove(&listener) {
            self.retry_at
                .insert(r.relay, Instant::now() + self.cfg.relay_retry);
            self.emit(NatEvent::RelayLost {
                relay: r.relay,
                reason,
            });
        }
    }

    /// Relay client events: reservations accepted, circuits opened.
    pub(super) fn on_relay_client(&mut self, event: relay::client::Event) {
        match event {
            relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal,
                ..
            } => {
                let now = Instant::now();
                let mut newly = false;
                for r in self.reservations.values_mut() {
                    if r.relay == relay_peer_id && !r.accepted {
                        r.accepted = true;
                        newly = true;
                    }
                }
                if renewal && !newly {
                    tracing::debug!(relay = %relay_peer_id, "relay reservation renewed");
                    return;
                }
                self.emit(NatEvent::RelayReserved {
                    relay: relay_peer_id,
                    since_start: now - self.started,
                    since_private: self.private_since.map_or(Duration::ZERO, |t| now - t),
                });
            }
            relay::client::Event::OutboundCircuitEstablished { relay_peer_id, .. } => {
                tracing::debug!(relay = %relay_peer_id, "outbound circuit established");
            }
            relay::client::Event::InboundCircuitEstablished { src_peer_id, .. } => {
                tracing::debug!(peer = %src_peer_id, "inbound circuit established");
            }
        }
    }

    /// Relay server events, logged.
    pub(super) fn on_relay_server(&self, event: relay::Event) {
        tracing::debug!(?event, "relay server");
    }

    /// A hole punch ended.
    pub(super) fn on_dcutr(&self, event: dcutr::Event) {
        let result = match event.result {
            Ok(connection) => match self.direct.get(&connection) {
                Some((addr, _)) => Ok(addr.clone()),
                None => Err("the direct connection closed at once".to_string()),
            },
            Err(e) => Err(e.to_string()),
        };
        self.emit(NatEvent::HolePunch {
            peer: event.remote_peer_id,
            result,
        });
    }

    /// While private, reserves slots on known relays until [`NatConfig::max_relays`] are held
    /// or asked for, skipping relays that failed within [`NatConfig::relay_retry`]. Called on
    /// each change and from the swarm task's periodic sweep.
    pub(super) fn maintain(&mut self, swarm: &mut Swarm<Behaviour>) {
        if self.reachability != Reachability::Private || !self.cfg.auto_relay {
            return;
        }
        let now = Instant::now();
        self.retry_at.retain(|_, at| *at > now);
        let held: HashSet<PeerId> = self.reservations.values().map(|r| r.relay).collect();
        let mut candidates: Vec<(PeerId, Multiaddr)> = self
            .relays
            .iter()
            .filter(|(p, _)| !held.contains(p) && !self.retry_at.contains_key(p))
            .map(|(p, a)| (*p, a.clone()))
            .collect();
        candidates.sort_by_key(|(p, _)| *p);
        let room = self.cfg.max_relays.saturating_sub(held.len());
        for (relay, addr) in candidates.into_iter().take(room) {
            let circuit = addr.with(Protocol::P2pCircuit);
            match swarm.listen_on(circuit.clone()) {
                Ok(id) => {
                    tracing::debug!(%circuit, "asking for a relay reservation");
                    self.reservations.insert(
                        id,
                        Reservation {
                            relay,
                            requested: now,
                            accepted: false,
                            announced: None,
                        },
                    );
                }
                Err(e) => {
                    self.retry_at.insert(relay, now + self.cfg.relay_retry);
                    self.emit(NatEvent::RelayLost {
                        relay,
                        reason: e.to_string(),
                    });
                }
            }
        }
        // A reservation the relay never answered is given up (its listener closes, and the
        // relay is retried later).
        for (id, r) in &self.reservations {
            if !r.accepted && now - r.requested > RESERVATION_TIMEOUT {
                swarm.remove_listener(*id);
            }
        }
    }
}

/// Whether `addr` goes through a relay.
fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| matches!(p, Protocol::P2pCircuit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_read_as_one_line_each() {
        let peer = PeerId::random();
        let reserved = NatEvent::RelayReserved {
            relay: peer,
            since_start: Duration::from_millis(1500),
            since_private: Duration::from_millis(20),
        };
        assert_eq!(
            reserved.to_string(),
            format!("relay reservation accepted by {peer} (1500 ms after start, 20 ms after autonat found this node private)")
        );
        let punched = NatEvent::HolePunch {
            peer,
            result: Ok("/ip4/10.0.0.1/tcp/4001".parse().unwrap()),
        };
        assert!(punched.to_string().contains("succeeded"));
        let failed = NatEvent::HolePunch {
            peer,
            result: Err("Giving up after 3 dial attempts".into()),
        };
        assert!(failed
            .to_string()
            .ends_with("failed: Giving up after 3 dial attempts"));
        assert_eq!(
            NatEvent::Reachability(Reachability::Private).to_string(),
            "reachability Private"
        );
        for e in [reserved, punched, failed] {
            assert!(!e.to_string().contains('\n'));
        }
    }

    #[test]
    fn circuit_addresses_are_relayed() {
        let peer = PeerId::random();
        let a: Multiaddr = format!("/ip4/10.0.0.1/tcp/1/p2p/{peer}/p2p-circuit")
            .parse()
            .unwrap();
        assert!(is_relayed(&a));
        assert!(!is_relayed(&"/ip4/10.0.0.1/tcp/1".parse().unwrap()));
    }
}
