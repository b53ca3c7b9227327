//! The connection manager: which peers' connections to close when a node holds more than its
//! high-water mark (see [`ConnectionLimits`] for the policy and why). Pure bookkeeping; the
//! swarm task feeds it connection and relay events and closes what [`Connections::take_prunable`]
//! names.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use libp2p::swarm::ConnectionId;
use libp2p::{relay, PeerId};

use crate::control::StreamUsage;
use crate::ConnectionLimits;

/// One connected peer.
struct Open {
    /// Its open connections.
    conns: Vec<ConnectionId>,
    /// When the newest of them was established.
    newest: Instant,
}

/// Open connections per peer, and what protects peers from pruning.
pub(super) struct Connections {
    limits: ConnectionLimits,
    peers: HashMap<PeerId, Open>,
    /// Which peer each open connection is to.
    owner: HashMap<ConnectionId, PeerId>,
    usage: StreamUsage,
    /// Peers holding a reservation on this node's relay server.
    reserved: HashSet<PeerId>,
    /// Circuits through this node's relay server, counted at both ends.
    circuits: HashMap<PeerId, usize>,
}

impl Connections {
    /// No connections yet; stream uses are read from `usage`.
    pub(super) fn new(limits: ConnectionLimits, usage: StreamUsage) -> Self {
        Connections {
            limits,
            peers: HashMap::new(),
            owner: HashMap::new(),
            usage,
            reserved: HashSet::new(),
            circuits: HashMap::new(),
        }
    }

    /// Open connections.
    pub(super) fn open(&self) -> usize {
        self.owner.len()
    }

    /// True when more connections are open than the high-water mark allows.
    pub(super) fn over_high_water(&self) -> bool {
        self.open() > self.limits.high_water
    }

    /// A connection to `peer` came up at `now`.
    pub(super) fn on_established(&mut self, peer: PeerId, id: ConnectionId, now: Instant) {
        if self.owner.insert(id, peer).is_some() {
            return;
        }
        let open = self.peers.entry(peer).or_insert(Open {
            conns: Vec::new(),
            newest: now,
        });
        open.conns.push(id);
        open.newest = now;
    }

    /// Connection `id` closed (for any reason, pruning included).
    pub(super) fn on_closed(&mut self, id: ConnectionId) {
        let Some(peer) = self.owner.remove(&id) else {
            return;
        };
        if let Some(open) = self.peers.get_mut(&peer) {
            open.conns.retain(|c| *c != id);
            if open.conns.is_empty() {
                self.peers.remove(&peer);
            }
        }
    }

    /// Follows this node's relay server: peers with a reservation or a circuit stay connected.
    pub(super) fn on_relay_server(&mut self, event: &relay::Event) {
        match event {
            relay::Event::ReservationReqAccepted { src_peer_id, .. } => {
                self.reserved.insert(*src_peer_id);
            }
            relay::Event::ReservationClosed { src_peer_id }
            | relay::Event::ReservationTimedOut { src_peer_id } => {
                self.reserved.remove(src_peer_id);
            }
            relay::Event::CircuitReqAccepted {
                src_peer_id,
                dst_peer_id,
            } => {
                for p in [src_peer_id, dst_peer_id] {
                    *self.circuits.entry(*p).or_default() += 1;
                }
            }
            relay::Event::CircuitClosed {
                src_peer_id,
                dst_peer_id,
                ..
            } => {
                for p in [src_peer_id, dst_peer_id] {
                    if let Some(n) = self.circuits.get_mut(p) {
                        *n -= 1;
                        if *n == 0 {
                            self.circuits.remove(p);
                        }
                    }
                }
            }
            _ => {}
        }
    }

    /// The peers to disconnect now: nothing while at most `high_water` connections are open;
    /// otherwise enough unprotected peers to get down to `low_water` (fewer when too many are
    /// protected), peers outside `routing` first, then the least recently used. Peers in
    /// `protected` (relays this node depends on) and peers used within the grace period are
    /// never named. The named peers are forgotten here at once, so a second call before their
    /// connections have closed does not count them again.
    pub(super) fn take_prunable(
        &mut self,
        now: Instant,
        routing: &HashSet<PeerId>,
        protected: &HashSet<PeerId>,
    ) -> Vec<PeerId> {
        if !self.over_high_water() {
            return Vec::new();
        }
        let grace = self.limits.grace;
        let mut candidates: Vec<(bool, Instant, PeerId, usize)> = self.usage.read(|used| {
            self.peers
                .iter()
                .filter(|(p, _)| {
                    !protected.contains(p)
                        && !self.reserved.contains(p)
                        && !self.circuits.contains_key(p)
                })
                .filter_map(|(p, open)| {
                    let last = used.get(p).map_or(open.newest, |t| (*t).max(open.newest));
                    (now.saturating_duration_since(last) >= grace).then_some((
                        routing.contains(p),
                        last,
                        *p,
                        open.conns.len(),
                    ))
                })
                .collect()
        });
        candidates.sort_unstable();
        let mut excess = self.open().saturating_sub(self.limits.low_water);
        let mut out = Vec::new();
        for (_, _, peer, conns) in candidates {
            if excess == 0 {
                break;
            }
            excess = excess.saturating_sub(conns);
            if let Some(open) = self.peers.remove(&peer) {
                for c in open.conns {
                    self.owner.remove(&c);
                }
            }
            out.push(peer);
        }
        out
    }

    /// Forgets stream uses of peers that are not connected and were last used over a grace
    /// period ago (the table stays as large as the connections).
    pub(super) fn forget_stale(&self, now: Instant) {
        let grace = self.limits.grace;
        self.usage
            .retain(|p, t| self.peers.contains_key(p) || now.saturating_duration_since(t) < grace);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn limits(low: usize, high: usize) -> ConnectionLimits {
        ConnectionLimits {
            low_water: low,
            high_water: high,
            grace: Duration::from_secs(10),
            max_established: None,
        }
    }

    /// `n` peers, one connection each, established one second apart starting at `t0`.
    fn connect(c: &mut Connections, n: usize, t0: Instant) -> Vec<PeerId> {
        (0..n)
            .map(|i| {
                let p = PeerId::random();
                c.on_established(
                    p,
                    ConnectionId::new_unchecked(i),
                    t0 + Duration::from_secs(i as u64),
                );
                p
            })
            .collect()
    }

    #[test]
    fn nothing_is_pruned_at_or_below_the_high_water_mark() {
        let mut c = Connections::new(limits(2, 4), StreamUsage::default());
        let t0 = Instant::now();
        connect(&mut c, 4, t0);
        let late = t0 + Duration::from_secs(100);
        assert!(c
            .take_prunable(late, &HashSet::new(), &HashSet::new())
            .is_empty());
        assert_eq!(c.open(), 4);
    }

    #[test]
    fn above_high_water_the_oldest_peers_outside_the_routing_table_go_first() {
        let mut c = Connections::new(limits(3, 5), StreamUsage::default());
        let t0 = Instant::now();
        let peers = connect(&mut c, 8, t0);
        // Peers 0 and 1 are in the routing table: kept although oldest.
        let routing: HashSet<PeerId> = peers[..2].iter().copied().collect();
        let pruned = c.take_prunable(t0 + Duration::from_secs(100), &routing, &HashSet::new());
        assert_eq!(
            pruned,
            peers[2..7].to_vec(),
            "five oldest outside the table"
        );
        assert_eq!(c.open(), 3);
        // Named peers are forgotten: a second call before they close prunes nothing more.
        assert!(c
            .take_prunable(t0 + Duration::from_secs(100), &routing, &HashSet::new())
            .is_empty());
        // Their close events arrive later and change nothing.
        for i in 2..7 {
            c.on_closed(ConnectionId::new_unchecked(i));
        }
        assert_eq!(c.open(), 3);
    }

    #[test]
    fn routing_table_peers_go_too_when_they_are_all_that_is_left() {
        let mut c = Connections::new(limits(2, 3), StreamUsage::default());
        let t0 = Instant::now();
        let peers = connect(&mut c, 5, t0);
        let routing: HashSet<PeerId> = peers.iter().copied().collect();
        let pruned = c.take_prunable(t0 + Duration::from_secs(100), &routing, &HashSet::new());
        assert_eq!(pruned, peers[..3].to_vec());
    }

    #[test]
    fn recent_peers_streams_relays_and_circuits_are_protected() {
        let usage = StreamUsage::default();
        let mut c = Connections::new(limits(0, 1), usage.clone());
        let t0 = Instant::now();
        let peers = connect(&mut c, 6, t0);
        let now = t0 + Duration::from_secs(30);
        // Peer 5 opened a second connection 5 s ago (within the 10 s grace); peer 0 had a
        // stream just now; peer 1 is a relay we depend on; peers 2 and 3 hold a
        // reservation and a circuit on our relay server.
        c.on_established(
            peers[5],
            ConnectionId::new_unchecked(99),
            now - Duration::from_secs(5),
        );
        usage.touch_at(peers[0], now);
        let protected: HashSet<PeerId> = [peers[1]].into_iter().collect();
        c.on_relay_server(&relay::Event::ReservationReqAccepted {
            src_peer_id: peers[2],
            renewed: false,
        });
        c.on_relay_server(&relay::Event::CircuitReqAccepted {
            src_peer_id: PeerId::random(),
            dst_peer_id: peers[3],
        });
        let pruned = c.take_prunable(now, &HashSet::new(), &protected);
        assert_eq!(pruned, vec![peers[4]], "only peer 4 is old and unprotected");
        // Once the circuit closes and the reservation times out, they may go.
        c.on_relay_server(&relay::Event::ReservationTimedOut {
            src_peer_id: peers[2],
        });
        c.on_relay_server(&relay::Event::CircuitClosed {
            src_peer_id: PeerId::random(),
            dst_peer_id: peers[3],
            error: None,
        });
        let later = now + Duration::from_secs(60);
        let mut pruned = c.take_prunable(later, &HashSet::new(), &protected);
        pruned.sort();
        let mut want = vec![peers[0], peers[2], peers[3], peers[5]];
        want.sort();
        assert_eq!(pruned, want);
    }

    #[test]
    fn a_peer_with_two_connections_counts_twice() {
        let mut c = Connections::new(limits(1, 2), StreamUsage::default());
        let t0 = Instant::now();
        let a = PeerId::random();
        let b = PeerId::random();
        c.on_established(a, ConnectionId::new_unchecked(1), t0);
        c.on_established(a, ConnectionId::new_unchecked(2), t0);
        c.on_established(
            b,
            ConnectionId::new_unchecked(3),
            t0 + Duration::from_secs(1),
        );
        assert_eq!(c.open(), 3);
        let pruned = c.take_prunable(
            t0 + Duration::from_secs(60),
            &HashSet::new(),
            &HashSet::new(),
        );
        assert_eq!(pruned, vec![a], "dropping a alone gets to one connection");
        assert_eq!(c.open(), 1);
        c.on_closed(ConnectionId::new_unchecked(3));
        assert_eq!(c.open(), 0);
    }

    #[test]
    fn stale_stream_uses_are_forgotten() {
        let usage = StreamUsage::default();
        let c = Connections::new(limits(1, 2), usage.clone());
        let t0 = Instant::now();
        let gone = PeerId::random();
        usage.touch_at(gone, t0);
        c.forget_stale(t0 + Duration::from_secs(5));
        assert!(usage.last(&gone).is_some(), "within grace");
        c.forget_stale(t0 + Duration::from_secs(11));
        assert!(usage.last(&gone).is_none());
    }
}
