//! Peers known to be down, and the behaviour that stops dials to them.
//!
//! A peer whose process died (SIGKILL, a crash, an OOM kill) leaves its addresses in every
//! routing table, declarations and progress records in the DHT, and the other peers keep
//! dialing it. Over TCP a dial fails at once ("connection refused"); over QUIC it can only time
//! out (UDP has no refusal), and libp2p fails a dial only when every address has: each dial
//! to the dead peer, by a DHT lookup or a stream, cost the caller the QUIC handshake timeout.
//! Eight peers training when one was SIGKILLed spent 8-12 s on such waits, one after another.
//!
//! The swarm task finds out instead: when a peer's last connection closes abnormally, it
//! connects to the peer's direct TCP addresses with a plain TCP socket (a probe: no libp2p
//! connection is made, so a peer that pruned the connection on purpose is not dialed back, and
//! the probe closes before any handshake). If every address *refuses* the connection, the host
//! is up and nothing listens where the peer did: the peer is marked down for [`DOWN_FOR`] (and
//! taken out of the routing table, its pending dials aborted). A probe that connected is made
//! once more a second later (a peer leaving properly may close its connections before its
//! listeners). While it is down, every
//! outbound dial to it is denied at once (this behaviour), so lookups, stream opens and
//! reachability checks move on without it, and readers of the DHT can skip what it wrote
//! ([`DownPeers`]). A connection from the peer (it restarted) clears the mark.
//!
//! What this cannot tell: a host that vanished altogether (power cut, cable) refuses nothing,
//! so its probe times out and nothing is marked (the QUIC idle timeout and the callers' own
//! timeouts still apply); a probe that fails any other way (unreachable network, a local
//! outage) marks nothing either, so losing this node's own network never flushes its view of
//! the swarm.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use libp2p::core::{transport::PortUse, Endpoint};
use libp2p::swarm::{
    dummy, ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm,
};
use libp2p::{Multiaddr, PeerId};

use crate::lock::lock;

/// How long a peer stays down after its probe was refused (unless it connects meanwhile).
pub const DOWN_FOR: Duration = Duration::from_secs(20);
/// Peers remembered at most (the oldest marks go first).
const MAX_DOWN: usize = 4096;

/// The peers this node knows to be down, shared between the swarm task and the node's handles.
///
/// ```
/// use starling_node::DownPeers;
/// let down = DownPeers::default();
/// let peer = libp2p::PeerId::random();
/// assert!(!down.is_down(&peer));
/// down.mark(peer);
/// assert!(down.is_down(&peer));
/// assert_eq!(down.list(), vec![peer]);
/// ```
#[derive(Clone, Default, Debug)]
pub struct DownPeers {
    since: Arc<Mutex<HashMap<PeerId, Instant>>>,
}

impl DownPeers {
    /// Marks `peer` down from now on (for [`DOWN_FOR`]).
    pub fn mark(&self, peer: PeerId) {
        let mut since = lock(&self.since);
        let now = Instant::now();
        since.retain(|_, at| now.duration_since(*at) < DOWN_FOR);
        if since.len() >= MAX_DOWN {
            if let Some(oldest) = since.iter().min_by_key(|(_, at)| **at).map(|(p, _)| *p) {
                since.remove(&oldest);
            }
        }
        since.insert(peer, now);
    }

    /// Clears `peer`'s mark (it connected again).
    pub fn clear(&self, peer: &PeerId) -> bool {
        lock(&self.since).remove(peer).is_some()
    }

    /// Whether `peer` is down now.
    pub fn is_down(&self, peer: &PeerId) -> bool {
        lock(&self.since)
            .get(peer)
            .is_some_and(|at| at.elapsed() < DOWN_FOR)
    }

    /// Every peer down now.
    pub fn list(&self) -> Vec<PeerId> {
        lock(&self.since)
            .iter()
            .filter(|(_, at)| at.elapsed() < DOWN_FOR)
            .map(|(p, _)| *p)
            .collect()
    }
}

/// Why a dial was denied.
#[derive(Debug, thiserror::Error)]
#[error("peer {0} is down: its addresses refused connections after it dropped every connection")]
pub struct PeerDown(pub PeerId);

/// The behaviour: denies outbound connections to down peers; an inbound one clears the mark.
pub(crate) struct Behaviour {
    down: DownPeers,
}

impl Behaviour {
    pub fn new(down: DownPeers) -> Self {
        Behaviour { down }
    }

    /// The shared set.
    pub fn peers(&self) -> &DownPeers {
        &self.down
    }
}

impl NetworkBehaviour for Behaviour {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = std::convert::Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        if self.down.clear(&peer) {
            tracing::debug!(%peer, "a peer marked down connected again");
        }
        Ok(dummy::ConnectionHandler)
    }

    fn handle_pending_outbound_connection(
        &mut self,
        _: ConnectionId,
        peer: Option<PeerId>,
        _: &[Multiaddr],
        _: Endpoint,
    ) -> Result<Vec<Multiaddr>, ConnectionDenied> {
        match peer {
            Some(peer) if self.down.is_down(&peer) => Err(ConnectionDenied::new(PeerDown(peer))),
            _ => Ok(Vec::new()),
        }
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        _: PeerId,
        _: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, _: FromSwarm) {}

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

/// Probes of a peer that neither connect nor are refused everywhere are tried again this many
/// times, after [`PROBE_RETRY`] times the attempt: a probe sent the moment a killed process's
/// connections reset can find its listening socket still open (and reset).
const PROBE_ATTEMPTS: u32 = 3;
/// The first retry's delay; the second waits twice as long.
const PROBE_RETRY: Duration = Duration::from_millis(250);
/// How long one probe connection may take.
const PROBE_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A probe that found the peer up is made once more after this: a peer that leaves properly
/// closes its connections and then its listeners, and a probe sent between the two (the others
/// probe when its connections close) found it up for good; CI saw one such peer never marked
/// down.
const UP_RECHECK: Duration = Duration::from_secs(1);

/// What a probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Every address refused the connection: nothing listens where the peer did.
    Down,
    /// An address accepted the connection.
    Up,
    /// Neither (timeouts, unreachable networks): nothing can be said.
    Unknown,
}

/// Probes `addrs` (plain TCP connects, closed at once), trying again a few times while the
/// answer is neither "up" nor "refused everywhere".
pub(crate) async fn probe(addrs: Vec<std::net::SocketAddr>) -> Verdict {
    if addrs.is_empty() {
        return Verdict::Unknown;
    }
    for attempt in 1..=PROBE_ATTEMPTS {
        let tries = addrs.iter().map(|a| async move {
            match tokio::time::timeout(PROBE_CONNECT_TIMEOUT, tokio::net::TcpStream::connect(a))
                .await
            {
                Ok(Ok(_)) => Verdict::Up,
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Verdict::Down,
                _ => Verdict::Unknown,
            }
        });
        let found = futures::future::join_all(tries).await;
        if found.contains(&Verdict::Up) {
            return Verdict::Up;
        }
        if found.iter().all(|v| *v == Verdict::Down) {
            return Verdict::Down;
        }
        if attempt < PROBE_ATTEMPTS {
            tokio::time::sleep(PROBE_RETRY * attempt).await;
        }
    }
    Verdict::Unknown
}

/// [`probe`], and once more [`UP_RECHECK`] later if it found the peer up: what the second
/// finds is the verdict.
pub(crate) async fn probe_settled(addrs: Vec<std::net::SocketAddr>) -> Verdict {
    probe_settled_after(addrs, UP_RECHECK).await
}

async fn probe_settled_after(addrs: Vec<std::net::SocketAddr>, recheck: Duration) -> Verdict {
    match probe(addrs.clone()).await {
        Verdict::Up => {
            tokio::time::sleep(recheck).await;
            probe(addrs).await
        }
        found => found,
    }
}

/// The addresses a probe connects to: `addrs`' direct TCP ones (no relay circuits, no QUIC).
pub(crate) fn probe_addrs<'a>(addrs: impl IntoIterator<Item = &'a Multiaddr>) -> Vec<Multiaddr> {
    use libp2p::multiaddr::Protocol;
    addrs
        .into_iter()
        .filter(|a| {
            a.iter().any(|p| matches!(p, Protocol::Tcp(_)))
                && !a.iter().any(|p| matches!(p, Protocol::P2pCircuit))
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_probe_tells_refused_from_listening() {
        let listening = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = listening.local_addr().unwrap();
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        assert_eq!(probe(vec![closed]).await, Verdict::Down);
        assert_eq!(probe(vec![closed, up]).await, Verdict::Up);
        assert_eq!(probe(Vec::new()).await, Verdict::Unknown);
    }

    /// A peer leaving properly: its listener closes a moment after the probe found it open.
    /// The settled probe looks again and finds it refused; one that stays open is up.
    #[tokio::test]
    async fn a_settled_probe_finds_a_listener_that_closed_after_the_first_look() {
        let leaving = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = leaving.local_addr().unwrap();
        let recheck = Duration::from_millis(300);
        let closes = async move {
            tokio::time::sleep(recheck / 3).await;
            drop(leaving);
        };
        let (verdict, ()) = tokio::join!(probe_settled_after(vec![addr], recheck), closes);
        assert_eq!(verdict, Verdict::Down);
        let staying = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = staying.local_addr().unwrap();
        assert_eq!(probe_settled_after(vec![addr], recheck).await, Verdict::Up);
    }

    #[test]
    fn probes_dial_direct_tcp_addresses_only() {
        let addrs: Vec<Multiaddr> = [
            "/ip4/127.0.0.1/tcp/4001",
            "/ip4/127.0.0.1/udp/4001/quic-v1",
            "/ip4/1.2.3.4/tcp/4001/p2p/12D3KooWGaC58GWzn3bdxHMx28Y883iwXWH9KvziWdLh8SxJB46G/p2p-circuit",
            "/ip6/::1/tcp/4002",
        ]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
        let picked = probe_addrs(&addrs);
        assert_eq!(picked, vec![addrs[0].clone(), addrs[3].clone()]);
    }

    #[test]
    fn marks_expire_and_clear() {
        let down = DownPeers::default();
        let p = PeerId::random();
        down.mark(p);
        assert!(down.is_down(&p));
        assert!(down.clear(&p));
        assert!(!down.is_down(&p));
        assert!(!down.clear(&p));
        // An old mark no longer counts.
        lock(&down.since).insert(p, Instant::now() - DOWN_FOR);
        assert!(!down.is_down(&p));
        assert!(down.list().is_empty());
    }
}
