//! The listening side of the fast lane: where it binds, answering offers on libp2p streams, and
//! admitting TCP connections that prove an offer.
//!
//! Nothing that arrives on the lane port is trusted before it proves an offer, and nothing it
//! sends can hold the listener: each connection gets [`HANDSHAKE_DEADLINE`] to send its token
//! and its exactly-sized hello, a [`Ticket`] bounds how many wait at once (in all and per source
//! IP, with room kept for IPs whose peers have offers pending), and a stream's buffers are
//! allocated only after the hello opened with the offer's keys.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Weak;
use std::time::Duration;

use futures::{AsyncWriteExt, StreamExt};
use libp2p::PeerId;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::time::{timeout, timeout_at, Instant};
use tracing::Instrument;

use super::gate::{Gate, Ticket};
use super::handshake::{Keys, HELLO, MAX_HANDSHAKE_MSG, MAX_LANE_ADDRS, READY};
use super::record::{open_greeting, seal_greeting, GREETING};
use super::{FastLane, FASTLANE_PROTOCOL};
use crate::framing::{read_msg, write_msg};
use crate::NodeError;
use starling_dht::lock::lock;

/// How long a new connection on the lane port has to send its token and hello (and to take
/// the answer): the dialer sends both at once, right after connecting.
pub(super) const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(1);
/// Unauthenticated connections at once, over all source IPs (those expected by a pending offer
/// come on top, see [`Gate`]).
pub(super) const MAX_UNAUTHENTICATED: usize = 64;
/// Unauthenticated connections at once from one source IP (again, expected ones on top).
pub(super) const MAX_UNAUTHENTICATED_PER_IP: usize = 8;
/// Offer streams answered at once, in all and per peer.
pub(super) const MAX_OFFER_STREAMS: usize = 64;
/// Offer streams answered at once for one peer.
pub(super) const MAX_OFFER_STREAMS_PER_PEER: usize = 8;
/// Longest wait for the IP of an offering peer's connection (a question to the swarm task).
const PEER_IP_TIMEOUT: Duration = Duration::from_secs(1);
/// Kernel queue of connections not yet accepted, per listener.
const BACKLOG: u32 = 1024;

/// The IPs the lane listens on for these TCP listen IPs: each distinct one, where an
/// unspecified address (all interfaces) stands for every other of its family; all IPv4
/// interfaces when there is none.
pub(crate) fn lane_ips(listen: impl IntoIterator<Item = IpAddr>) -> Vec<IpAddr> {
    let listen: Vec<IpAddr> = listen.into_iter().map(|ip| ip.to_canonical()).collect();
    let any = |v4: bool| {
        listen
            .iter()
            .any(|ip| ip.is_unspecified() && ip.is_ipv4() == v4)
    };
    let (any4, any6) = (any(true), any(false));
    let mut ips: Vec<IpAddr> = Vec::new();
    for ip in listen {
        let covered = if ip.is_ipv4() { any4 } else { any6 };
        if (covered && !ip.is_unspecified()) || ips.contains(&ip) {
            continue;
        }
        ips.push(ip);
    }
    if ips.is_empty() {
        ips.push(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    }
    ips.truncate(MAX_LANE_ADDRS);
    ips
}

/// Binds a listener on `addr` with a deep accept queue.
fn bind_one(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// Binds one listener per IP, all on `port` where possible (the first bound port when `port` is
/// 0). A later IP whose port is taken (`[::]` next to `0.0.0.0` on a dual-stack host) gets a
/// port of its own when none was asked for, else is left out with a warning; only the first
/// IP's failure is an error.
pub(super) fn bind(ips: &[IpAddr], port: u16) -> Result<Vec<TcpListener>, NodeError> {
    let mut listeners: Vec<TcpListener> = Vec::new();
    let mut shared = port;
    for ip in ips {
        let bound = bind_one(SocketAddr::new(*ip, shared)).or_else(|e| match port {
            0 if !listeners.is_empty() => bind_one(SocketAddr::new(*ip, 0)),
            _ => Err(e),
        });
        match bound {
            Ok(l) => {
                if shared == 0 {
                    shared = l.local_addr().map(|a| a.port()).unwrap_or(0);
                }
                listeners.push(l);
            }
            Err(e) if listeners.is_empty() => {
                return Err(NodeError::Listen {
                    addr: format!("{} (fast lane)", SocketAddr::new(*ip, port)),
                    reason: crate::error_chain(&e),
                })
            }
            Err(e) => tracing::warn!(%ip, port, "fast lane not listening there: {e}"),
        }
    }
    Ok(listeners)
}

/// Answers lane requests on [`FASTLANE_PROTOCOL`] streams until the lane state is gone.
pub(super) async fn serve_offers(lane: Weak<FastLane>, mut control: crate::StreamControl) {
    let Ok(mut incoming) = control.accept(FASTLANE_PROTOCOL) else {
        tracing::warn!("fast lane protocol already registered; lanes disabled");
        return;
    };
    let gate = Gate::new(MAX_OFFER_STREAMS, MAX_OFFER_STREAMS_PER_PEER);
    while let Some((peer, mut stream)) = incoming.next().await {
        let Some(lane) = lane.upgrade() else { return };
        let Some(ticket) = Ticket::take(&gate, peer, 0) else {
            continue; // dropped: the peer retries with a fresh offer
        };
        let handshake = async move {
            let _ticket = ticket;
            let _ = timeout(lane.timeout, async {
                let msg = read_msg(&mut stream, MAX_HANDSHAKE_MSG).await?;
                let ip = lane.peer_ip(peer).await;
                let reply = lane.offer(peer, ip, msg);
                write_msg(&mut stream, &reply).await?;
                stream.close().await
            })
            .await;
        }
        .in_current_span();
        tokio::spawn(handshake);
    }
}

/// Accepts TCP connections on one lane listener and admits those that prove an offer.
pub(super) async fn serve_connections(lane: Weak<FastLane>, listener: TcpListener) {
    loop {
        let (tcp, from) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!("fast lane accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(lane) = lane.upgrade() else { return };
        let Some(ticket) = lane.ticket_for(from.ip()) else {
            tracing::trace!(%from, "fast lane connection reset: too many unauthenticated");
            let _ = tcp.set_zero_linger(); // no TIME_WAIT left behind
            continue;
        };
        let handshake = async move {
            if let Err(e) = lane.admit(tcp, Some(ticket)).await {
                tracing::debug!(%from, "fast lane refused: {e}");
            }
        }
        .in_current_span();
        tokio::spawn(handshake);
    }
}

impl FastLane {
    /// A place for a new connection from `ip` while it proves an offer, or `None` when it must
    /// be turned away (see [`Gate`]): IPs with offers pending get one place per offer first.
    pub(super) fn ticket_for(&self, ip: IpAddr) -> Option<Ticket<IpAddr>> {
        let ip = ip.to_canonical();
        let expected = lock(&self.offers).waiting_from(ip, Instant::now());
        Ticket::take(&self.unauthenticated, ip, expected)
    }

    /// The IP of `peer`'s libp2p connection, where the swarm task tells it in time.
    async fn peer_ip(&self, peer: PeerId) -> Option<IpAddr> {
        let ask = self.peer_ip.as_ref()?(peer);
        let ip = timeout(PEER_IP_TIMEOUT, ask).await.ok().flatten()?;
        Some(ip.to_canonical())
    }

    /// Authenticates one inbound TCP connection within [`HANDSHAKE_DEADLINE`] and routes it to
    /// its protocol's handler; `ticket`, its place among unauthenticated connections, is given
    /// back as soon as it has proven its offer. A connection refused is reset, not closed, so
    /// that a flood leaves no `TIME_WAIT` sockets behind on the lane port.
    pub(super) async fn admit(
        &self,
        mut tcp: TcpStream,
        ticket: Option<Ticket<IpAddr>>,
    ) -> io::Result<()> {
        let deadline = Instant::now() + HANDSHAKE_DEADLINE;
        let proven = timeout_at(deadline, self.prove(&mut tcp, ticket))
            .await
            .unwrap_or_else(|_| {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no token and hello in time",
                ))
            });
        match proven {
            Ok((peer, keys, place)) => {
                let lane = self.lane(tcp, &keys, false)?;
                place.send((peer, lane));
                Ok(())
            }
            Err(e) => {
                let _ = tcp.set_zero_linger();
                Err(e)
            }
        }
    }

    /// The token, then the hello sealed with the offer's key, exactly [`GREETING`] bytes; then
    /// a place in the handler's queue, and only then READY. Returns the peer, the lane's keys
    /// and the place.
    async fn prove(
        &self,
        tcp: &mut TcpStream,
        ticket: Option<Ticket<IpAddr>>,
    ) -> io::Result<(PeerId, Keys, Place)> {
        tcp.set_nodelay(true)?;
        let mut token = [0u8; 16];
        tcp.read_exact(&mut token).await?;
        let found = lock(&self.offers).get(&token, Instant::now());
        let Some((peer, protocol, keys)) = found else {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "unknown token",
            ));
        };
        let mut hello = [0u8; GREETING];
        tcp.read_exact(&mut hello).await?;
        if &open_greeting(&keys[..32], &hello)? != HELLO {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "bad lane hello"));
        }
        // The first record opened with the offer's key: the dialer is who the offer came from.
        if !lock(&self.offers).take(&token) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "token used",
            ));
        }
        // Its offer is gone, so its IP expects one lane less: its place must go too, or the
        // next dialer from that IP would find the room kept for it taken.
        drop(ticket);
        let route = lock(&self.routes).get(&protocol).cloned();
        let Some(route) = route else {
            return Err(io::Error::other("handler gone"));
        };
        // A lane answered READY is a lane the handler gets: no READY without a place.
        let place = route
            .try_reserve_owned()
            .map_err(|_| io::Error::other("handler queue full"))?;
        tcp.write_all(&seal_greeting(&keys[32..], READY)?).await?;
        Ok((peer, keys, place))
    }
}

/// A reserved place in a handler's queue of inbound lanes.
type Place = tokio::sync::mpsc::OwnedPermit<(PeerId, super::FastStream)>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lane_listens_where_libp2p_listens() {
        let ips = |v: &[&str]| -> Vec<IpAddr> { v.iter().map(|s| s.parse().unwrap()).collect() };
        assert_eq!(lane_ips(ips(&["0.0.0.0"])), ips(&["0.0.0.0"]));
        assert_eq!(lane_ips(ips(&["127.0.0.1"])), ips(&["127.0.0.1"]));
        assert_eq!(
            lane_ips(ips(&["10.0.0.1", "127.0.0.1", "10.0.0.1"])),
            ips(&["10.0.0.1", "127.0.0.1"])
        );
        assert_eq!(
            lane_ips(ips(&["127.0.0.1", "0.0.0.0", "::1", "::"])),
            ips(&["0.0.0.0", "::"])
        );
        assert_eq!(lane_ips(ips(&["::", "10.0.0.1"])), ips(&["::", "10.0.0.1"]));
        assert_eq!(lane_ips(Vec::new()), ips(&["0.0.0.0"]));
    }

    #[tokio::test]
    async fn one_port_serves_every_listen_ip() {
        let ips: Vec<IpAddr> = ["127.0.0.1", "127.0.0.2"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let listeners = bind(&ips, 0).unwrap();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        assert_eq!(addrs.len(), 2);
        assert_eq!(addrs[0].ip(), ips[0]);
        assert_eq!(addrs[1].ip(), ips[1]);
        assert_eq!(addrs[0].port(), addrs[1].port());
        // An explicit port that is taken is an error that names the lane.
        let taken = addrs[0].port();
        match bind(&ips[..1], taken) {
            Err(NodeError::Listen { addr, .. }) => assert!(addr.contains("fast lane"), "{addr}"),
            other => panic!("expected a listen error, got {:?}", other.map(|v| v.len())),
        }
    }
}
