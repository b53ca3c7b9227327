//! The swarm task: the one tokio task that owns a node's libp2p `Swarm`.
//!
//! [`Node`](super::Node) handles send it [`Command`]s over a bounded channel, each with a
//! oneshot for the answer; the task's loop takes commands, swarm events and a periodic sweep of
//! expired DHT entries in turn, and never awaits anything else, so no handle waits on a lock.
//! Commands that need the network (dials, DHT queries) park their reply until the matching
//! swarm event arrives; Kademlia's part of that lives in [`Queries`].

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use futures::StreamExt;
use libp2p::kad::{Record, RecordKey};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{
    dial_opts::{DialOpts, PeerCondition},
    ConnectionId, DialError, SwarmEvent,
};
use libp2p::{autonat, identify, Multiaddr, PeerId, StreamProtocol, Swarm};
use starling_dht::{now_ms, DictionaryRecord, Validator};
use tokio::sync::{mpsc, oneshot};

use super::connections::Connections;
use super::nat::{Nat, NatEvents};
use super::queries::{GetMode, Kad, Queries, Reply};
use super::transport::{direct_ip, on_remote_ip, peer_of, tcp_socket};
use super::{NodeStatus, PutReport};
use crate::behaviour::{Behaviour, BehaviourEvent};
use crate::control::StreamUsage;
use crate::down::{probe_addrs, probe_settled, Verdict};
use crate::metrics::Metrics;
use crate::{NodeConfig, NodeError};

/// How often expired DHT entries are swept from the local store.
const SWEEP_INTERVAL: Duration = Duration::from_secs(5);

/// What a [`Node`](super::Node) handle asks of the swarm task; each carries its reply channel.
pub(super) enum Command {
    ListenAddrs(oneshot::Sender<Vec<Multiaddr>>),
    Dial(Multiaddr, Reply<PeerId>),
    Bootstrap(Reply<super::BootstrapReport>),
    Status(oneshot::Sender<NodeStatus>),
    ConnectedPeers(oneshot::Sender<Vec<PeerId>>),
    Put(Record, Reply<PutReport>),
    /// Fault injection: a record sent to every connected peer as it is.
    #[cfg(feature = "testing")]
    PutRawToConnected(Record, Reply<PutReport>),
    Get(RecordKey, GetMode, Reply<Option<DictionaryRecord>>),
    GetLocal(RecordKey, oneshot::Sender<Option<DictionaryRecord>>),
    PeerIp(PeerId, oneshot::Sender<Option<IpAddr>>),
    /// Every direct TCP address of this peer refused a dial ([`Node::connect_if_needed`]):
    /// the same as a probe that found it down.
    ///
    /// [`Node::connect_if_needed`]: super::Node::connect_if_needed
    MarkDown(PeerId, oneshot::Sender<()>),
    Shutdown(oneshot::Sender<()>),
}

/// The Kademlia behaviour inside a node's swarm.
fn kad(swarm: &mut Swarm<Behaviour>) -> &mut Kad {
    &mut swarm.behaviour_mut().kad
}

/// The swarm task's state.
pub(super) struct Actor {
    swarm: Swarm<Behaviour>,
    listen_addrs: Vec<Multiaddr>,
    /// The remote IP of each peer with a direct connection (for fast lanes).
    peer_ips: HashMap<PeerId, IpAddr>,
    pending_dials: HashMap<ConnectionId, (Multiaddr, Reply<PeerId>)>,
    queries: Queries,
    /// Reachability, relay reservations, hole punches.
    nat: Nat,
    /// Peers that announce this protocol in identify get into the routing table.
    kad_protocol: StreamProtocol,
    /// libp2p's metrics and the node's gauges.
    metrics: Metrics,
    /// The connection manager's bookkeeping.
    connections: Connections,
    /// Probes of peers whose last connection closed abnormally ([`crate::down`]); aborted
    /// with the task.
    probes: tokio::task::JoinSet<(PeerId, Verdict)>,
}

/// Probes in flight at most (a mass departure probes the first this many peers).
const MAX_PROBES: usize = 64;

impl Actor {
    /// The task's state for a swarm that already listens on `listen_addrs`; NAT events go to
    /// `nat_events`; streams opened through the node's handles are recorded in `usage`. The
    /// configured external addresses are confirmed here.
    pub(super) fn new(
        mut swarm: Swarm<Behaviour>,
        listen_addrs: Vec<Multiaddr>,
        validator: Validator,
        cfg: &NodeConfig,
        nat_events: &NatEvents,
        metrics: Metrics,
        usage: StreamUsage,
    ) -> Result<Self, NodeError> {
        for addr in &cfg.external_addrs {
            swarm.add_external_address(addr.clone());
        }
        Ok(Actor {
            swarm,
            listen_addrs,
            peer_ips: HashMap::new(),
            pending_dials: HashMap::new(),
            queries: Queries::new(
                validator,
                cfg.put_quorum,
                cfg.request_timeout / 2,
                cfg.request_timeout / 4,
            ),
            nat: Nat::new(cfg, nat_events.sender()),
            kad_protocol: StreamProtocol::try_from_owned(cfg.kad_protocol.clone())
                .map_err(|e| NodeError::Config(format!("kad protocol name: {e}")))?,
            metrics,
            connections: Connections::new(cfg.connections, usage),
            probes: tokio::task::JoinSet::new(),
        })
    }

    /// Runs until a [`Command::Shutdown`] arrives or every handle is gone.
    pub(super) async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        let mut sweep = tokio::time::interval(SWEEP_INTERVAL);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                cmd = rx.recv() => match cmd {
                    Some(Command::Shutdown(reply)) => {
                        self.close();
                        let _ = reply.send(());
                        break;
                    }
                    Some(cmd) => self.on_command(cmd),
                    None => {
                        self.close();
                        break;
                    }
                },
                event = self.swarm.select_next_some() => self.on_event(event),
                Some(Ok((peer, verdict))) = self.probes.join_next(), if !self.probes.is_empty() => {
                    self.on_probed(peer, verdict);
                }
                id = self.queries.next_deadline() => {
                    self.queries.on_deadline(kad(&mut self.swarm), id);
                }
                _ = sweep.tick() => {
                    self.swarm.behaviour_mut().kad.store_mut().remove_expired(now_ms());
                    self.nat.maintain(&mut self.swarm);
                    self.prune_connections();
                    self.connections.forget_stale(Instant::now());
                    self.update_gauges();
                }
            }
        }
        tracing::debug!("swarm task stopped");
    }

    fn close(&mut self) {
        let peers: Vec<PeerId> = self.swarm.connected_peers().copied().collect();
        for p in peers {
            let _ = self.swarm.disconnect_peer_id(p);
        }
        // Pending callers learn the node is closed when their oneshots drop with `self`.
    }

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::ListenAddrs(reply) => {
                let _ = reply.send(self.listen_addrs.clone());
            }
            Command::Dial(addr, reply) => self.dial(addr, reply),
            Command::Bootstrap(reply) => self.queries.bootstrap(kad(&mut self.swarm), reply),
            Command::Status(reply) => {
                let _ = reply.send(self.status());
            }
            Command::ConnectedPeers(reply) => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::Put(record, reply) => self.queries.put(kad(&mut self.swarm), record, reply),
            #[cfg(feature = "testing")]
            Command::PutRawToConnected(record, reply) => {
                let peers: Vec<PeerId> = self.swarm.connected_peers().copied().collect();
                self.queries
                    .put_to(kad(&mut self.swarm), record, peers, reply);
            }
            Command::Get(key, mode, reply) => {
                self.queries.get(kad(&mut self.swarm), key, mode, reply)
            }
            Command::GetLocal(key, reply) => {
                let store = kad(&mut self.swarm).store_mut();
                let _ = reply.send(store.get_live(key.as_ref(), now_ms()));
            }
            Command::PeerIp(peer, reply) => {
                let ip = self
                    .swarm
                    .is_connected(&peer)
                    .then(|| self.peer_ips.get(&peer).copied())
                    .flatten();
                let _ = reply.send(ip);
            }
            Command::MarkDown(peer, reply) => {
                self.mark_down(peer);
                let _ = reply.send(());
            }
            Command::Shutdown(_) => unreachable!("handled in run"),
        }
    }

    /// Starts a dial; `reply` is answered when the connection is up or has failed.
    fn dial(&mut self, addr: Multiaddr, reply: Reply<PeerId>) {
        let opts = match peer_of(&addr) {
            Some(peer) => DialOpts::peer_id(peer)
                .condition(PeerCondition::Always)
                .addresses(vec![addr.clone()])
                .build(),
            None => DialOpts::unknown_peer_id().address(addr.clone()).build(),
        };
        let id = opts.connection_id();
        match self.swarm.dial(opts) {
            Ok(()) => {
                self.pending_dials.insert(id, (addr, reply));
            }
            Err(e) => {
                let _ = reply.send(Err(NodeError::Dial {
                    addr: addr.to_string(),
                    reason: crate::error_chain(&e),
                }));
            }
        }
    }

    fn status(&mut self) -> NodeStatus {
        let peer_id = *self.swarm.local_peer_id();
        let routing_table = self
            .swarm
            .behaviour_mut()
            .kad
            .kbuckets()
            .map(|b| b.num_entries())
            .sum();
        let stats = self.swarm.behaviour_mut().kad.store_mut().stats();
        NodeStatus {
            peer_id: peer_id.to_string(),
            listen_addrs: self
                .listen_addrs
                .iter()
                .map(|a| a.clone().with(Protocol::P2p(peer_id)).to_string())
                .collect(),
            connected_peers: self.swarm.connected_peers().count(),
            routing_table,
            records: stats.records,
            record_bytes: stats.bytes,
            rejected_records: stats.rejected,
            reachability: self.nat.reachability(),
        }
    }

    /// Closes the connections the connection manager names (none while under its high-water
    /// mark).
    fn prune_connections(&mut self) {
        if !self.connections.over_high_water() {
            return;
        }
        let routing: HashSet<PeerId> = self
            .swarm
            .behaviour_mut()
            .kad
            .kbuckets()
            .flat_map(|b| b.iter().map(|e| *e.node.key.preimage()).collect::<Vec<_>>())
            .collect();
        let protected: HashSet<PeerId> = self.nat.reserved_relays().collect();
        let open = self.connections.open();
        let pruned = self
            .connections
            .take_prunable(Instant::now(), &routing, &protected);
        if pruned.is_empty() {
            return;
        }
        tracing::debug!(
            open,
            pruned = pruned.len(),
            left = self.connections.open(),
            "over the connection high-water mark: closing the least used"
        );
        self.metrics
            .node()
            .connections_pruned
            .inc_by(pruned.len() as u64);
        for peer in pruned {
            let _ = self.swarm.disconnect_peer_id(peer);
        }
    }

    /// A dial to `peer` failed on every address it tried, and no connection to it is left:
    /// takes it out of Kademlia's routing table. libp2p-kad itself only drops the failed
    /// addresses but the last, and keeps the peer (so that a local outage does not flush the
    /// table) until a newer peer wants its bucket slot. In a swarm whose other peers have
    /// left, none ever does: every lookup then dials the dead peers again and cannot end
    /// before the slowest dial fails, which for a QUIC address is the 5 s handshake timeout
    /// (UDP has no "connection refused"), so every DHT read and write of a lone peer took
    /// about 5 s. A peer that is alive comes back with its addresses through identify on its
    /// next connection, in either direction.
    fn forget_unreachable(&mut self, peer: PeerId, error: &DialError) {
        if !matches!(error, DialError::Transport(_)) || self.swarm.is_connected(&peer) {
            return;
        }
        if kad(&mut self.swarm).remove_peer(&peer).is_some() {
            tracing::debug!(%peer, "unreachable: removed from the routing table");
            self.update_gauges();
        }
    }

    /// `peer`'s last connection closed abnormally (`closed` was its remote address if this
    /// node dialed it): probe its direct TCP addresses ([`crate::down`]); the verdict comes
    /// back to [`Self::on_probed`].
    fn probe(&mut self, peer: PeerId, closed: Option<&Multiaddr>) {
        if self.probes.len() >= MAX_PROBES {
            return;
        }
        let mut known: Vec<Multiaddr> = closed.into_iter().cloned().collect();
        if let Some(bucket) = kad(&mut self.swarm).kbucket(peer) {
            if let Some(entry) = bucket.iter().find(|e| *e.node.key.preimage() == peer) {
                known.extend(entry.node.value.iter().cloned());
            }
        }
        let mut sockets: Vec<SocketAddr> =
            probe_addrs(&known).iter().filter_map(tcp_socket).collect();
        sockets.sort_unstable();
        sockets.dedup();
        if sockets.is_empty() {
            return;
        }
        self.probes
            .spawn(async move { (peer, probe_settled(sockets).await) });
    }

    /// A probe of `peer` ended: if every address refused, the peer is down.
    fn on_probed(&mut self, peer: PeerId, verdict: Verdict) {
        tracing::debug!(%peer, ?verdict, "probed");
        // (A peer that connected again while its probe ran is up, whatever the probe found.)
        if verdict == Verdict::Down && !self.swarm.is_connected(&peer) {
            self.mark_down(peer);
        }
    }

    /// `peer`'s TCP addresses refuse connections (and no connection to it is open): it is
    /// down. Its pending dials are aborted (their callers fail now, not at the QUIC handshake
    /// timeout), it leaves the routing table, and dials to it are denied for
    /// [`crate::DOWN_FOR`].
    fn mark_down(&mut self, peer: PeerId) {
        if self.swarm.is_connected(&peer) {
            return;
        }
        tracing::debug!(%peer, "down: its TCP addresses refuse connections");
        self.swarm.behaviour().down.peers().mark(peer);
        let _ = self.swarm.disconnect_peer_id(peer);
        kad(&mut self.swarm).remove_peer(&peer);
        self.metrics.node().peers_down.inc();
        self.update_gauges();
    }

    /// Sets the node's gauges from the swarm's state (on connection changes and every sweep).
    fn update_gauges(&mut self) {
        let status = self.status();
        let m = self.metrics.node();
        m.peers_connected.set(status.connected_peers as i64);
        m.routing_table.set(status.routing_table as i64);
        m.dht_records.set(status.records as i64);
        m.dht_record_bytes.set(status.record_bytes as i64);
    }

    fn on_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        self.metrics.record_libp2p(&event);
        if matches!(
            event,
            SwarmEvent::ConnectionEstablished { .. } | SwarmEvent::ConnectionClosed { .. }
        ) {
            let m = self.metrics.node();
            m.peers_connected
                .set(self.swarm.connected_peers().count() as i64);
        }
        match event {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => {
                self.nat
                    .on_new_listen_addr(listener_id, &address, *self.swarm.local_peer_id());
                if !self.listen_addrs.contains(&address) {
                    self.listen_addrs.push(address);
                }
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                self.listen_addrs.retain(|a| a != &address);
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                ..
            } => {
                let reason = match reason {
                    Ok(()) => "listener closed".to_string(),
                    Err(e) => crate::error_chain(&e),
                };
                self.nat.on_listener_closed(listener_id, reason);
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                ..
            } => {
                self.nat.on_connection_established(connection_id, &endpoint);
                self.connections
                    .on_established(peer_id, connection_id, Instant::now());
                self.prune_connections();
                if let Some(ip) = direct_ip(endpoint.get_remote_address()) {
                    self.peer_ips.insert(peer_id, ip);
                }
                if let Some((addr, reply)) = self.pending_dials.remove(&connection_id) {
                    if endpoint.is_dialer() {
                        self.swarm
                            .behaviour_mut()
                            .kad
                            .add_address(&peer_id, endpoint.get_remote_address().clone());
                    }
                    tracing::debug!(%peer_id, %addr, "connected");
                    let _ = reply.send(Ok(peer_id));
                }
            }
            SwarmEvent::OutgoingConnectionError {
                connection_id,
                peer_id,
                error,
            } => {
                if let Some(peer) = peer_id {
                    self.forget_unreachable(peer, &error);
                }
                if let Some((addr, reply)) = self.pending_dials.remove(&connection_id) {
                    let _ = reply.send(Err(NodeError::Dial {
                        addr: addr.to_string(),
                        reason: crate::error_chain(&error),
                    }));
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                cause,
                num_established,
                endpoint,
                ..
            } => {
                tracing::debug!(%peer_id, ?cause, num_established, "connection closed");
                self.nat.on_connection_closed(connection_id);
                self.connections.on_closed(connection_id);
                if num_established == 0 {
                    self.peer_ips.remove(&peer_id);
                    if cause.is_some() {
                        let dialed = endpoint.is_dialer().then(|| endpoint.get_remote_address());
                        self.probe(peer_id, dialed);
                    }
                }
            }
            SwarmEvent::IncomingConnectionError {
                error,
                send_back_addr,
                ..
            } => {
                tracing::debug!(%send_back_addr, "inbound connection failed: {error}");
            }
            SwarmEvent::Behaviour(event) => self.on_behaviour(event),
            _ => {}
        }
    }

    fn on_behaviour(&mut self, event: BehaviourEvent) {
        match &event {
            BehaviourEvent::Kad(e) => self.metrics.record_libp2p(e),
            BehaviourEvent::Identify(e) => self.metrics.record_libp2p(e),
            BehaviourEvent::Ping(e) => self.metrics.record_libp2p(e),
            BehaviourEvent::RelayServer(e) => self.metrics.record_libp2p(e),
            BehaviourEvent::Dcutr(e) => self.metrics.record_libp2p(e),
            _ => {}
        }
        match event {
            BehaviourEvent::Identify(identify::Event::Received {
                connection_id,
                peer_id,
                info,
            }) => {
                self.nat
                    .on_identify(&mut self.swarm, peer_id, connection_id, &info);
                let dialable = match self.nat.remote_addr(connection_id) {
                    Some(remote) => on_remote_ip(&info.listen_addrs, remote),
                    None => Vec::new(),
                };
                let kad = &mut self.swarm.behaviour_mut().kad;
                if info.protocols.contains(&self.kad_protocol) {
                    for addr in dialable {
                        kad.add_address(&peer_id, addr);
                    }
                } else {
                    // Not (or no longer) a Kademlia server: a peer behind a NAT that switched
                    // to client mode must not stay in the routing table.
                    kad.remove_peer(&peer_id);
                }
            }
            BehaviourEvent::Autonat(autonat::Event::StatusChanged { new, .. }) => {
                self.nat.on_autonat(&mut self.swarm, new);
            }
            BehaviourEvent::RelayClient(event) => self.nat.on_relay_client(event),
            BehaviourEvent::RelayServer(event) => {
                self.connections.on_relay_server(&event);
                self.nat.on_relay_server(event);
            }
            BehaviourEvent::Dcutr(event) => self.nat.on_dcutr(event),
            BehaviourEvent::Kad(event) => self.queries.on_event(kad(&mut self.swarm), event),
            _ => {}
        }
    }
}
