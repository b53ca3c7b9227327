//! Building a node's swarm (transports, behaviour, swarm config), bringing its listeners up,
//! and the small multiaddr helpers the rest of the node uses.
//!
//! A private swarm runs TCP + pnet + noise + yamux and nothing else: pnet covers TCP only, so
//! a QUIC listener would let a keyless peer in ([`check_private_swarm`] refuses such configs).
//! A public swarm runs TCP + noise + yamux and QUIC. Both add DNS and the relay client. With a
//! simulated round-trip time ([`crate::simdelay`], for benches) TCP's reads are delayed and
//! QUIC is off.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use futures::StreamExt;
use libp2p::core::{muxing::StreamMuxerBox, transport::Boxed, upgrade::Version};
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::SwarmEvent;
use libp2p::{noise, tcp, yamux, Multiaddr, PeerId, Swarm, Transport};

use crate::behaviour::{self, Behaviour};
use crate::metrics::Metrics;
use crate::{NodeConfig, NodeError};

/// A QUIC connection with no packet for this long is closed. A peer that crashes closes no
/// QUIC connection (UDP has no reset): until this passes, its connections look open and every
/// request to it waits (libp2p's default of 10 s made a crashed peer of eight cost the others
/// a 10 s averaging round and 5 s progress reads). Live connections send a keep-alive every
/// [`QUIC_KEEP_ALIVE`], so only a path silent for three of those in a row is given up on.
const QUIC_IDLE_TIMEOUT: Duration = Duration::from_secs(3);
/// How often an otherwise idle QUIC connection sends a keep-alive.
const QUIC_KEEP_ALIVE: Duration = Duration::from_secs(1);
/// How long start-up waits for listeners to report their addresses.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Refuses QUIC addresses (to listen on or to bootstrap from) where QUIC would bypass what the
/// config asks of every connection: a private swarm's key, a simulated round-trip time.
pub(super) fn check_private_swarm(cfg: &NodeConfig, listen: &[Multiaddr]) -> Result<(), NodeError> {
    let reason = if cfg.swarm_key.is_some() {
        "in a private swarm (the pre-shared key protects TCP only)"
    } else if cfg.simulated_rtt.is_some() {
        "with a simulated round-trip time (UDP would pass around the delay)"
    } else {
        return Ok(());
    };
    match listen.iter().chain(&cfg.bootstrap).find(|a| is_quic(a)) {
        Some(a) => Err(NodeError::Config(format!(
            "{a}: QUIC cannot be used {reason}"
        ))),
        None => Ok(()),
    }
}

/// Builds the swarm: the private (TCP + pnet) or public (TCP + QUIC) transport stack, DNS, the
/// relay client and [`Behaviour`].
pub(super) fn build_swarm(
    key: &Keypair,
    cfg: &NodeConfig,
    metrics: &Metrics,
) -> Result<Swarm<Behaviour>, NodeError> {
    let idle = cfg.idle_connection_timeout;
    let tr = |e: &dyn std::fmt::Display| NodeError::Transport(e.to_string());
    // libp2p's transport metrics (bytes in and out per transport stack) go in the node's registry.
    let mut registry = metrics.root();
    match (cfg.swarm_key, cfg.simulated_rtt) {
        (None, None) => {
            let swarm = libp2p::SwarmBuilder::with_existing_identity(key.clone())
                .with_tokio()
                .with_tcp(
                    tcp::Config::default().nodelay(true),
                    noise::Config::new,
                    yamux::Config::default,
                )
                .map_err(|e| tr(&e))?
                .with_quic_config(|mut c| {
                    c.max_idle_timeout = QUIC_IDLE_TIMEOUT.as_millis() as u32;
                    c.keep_alive_interval = QUIC_KEEP_ALIVE;
                    c
                })
                .with_dns()
                .map_err(|e| tr(&e))?
                .with_relay_client(noise::Config::new, yamux::Config::default)
                .map_err(|e| tr(&e))?
                .with_bandwidth_metrics(&mut registry)
                .with_behaviour(|key, relay| {
                    behaviour::build(key, relay, cfg)
                        .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
                })
                .map_err(|e| tr(&e))?
                .with_swarm_config(|c| c.with_idle_connection_timeout(idle))
                .build();
            Ok(swarm)
        }
        (swarm_key, rtt) => {
            // TCP only: with pnet (a private swarm), and/or each connection's reads delayed
            // (a simulated round-trip time, for benches).
            let psk = swarm_key.map(|k| k.psk());
            let half = rtt.map(|rtt| rtt / 2);
            let swarm = libp2p::SwarmBuilder::with_existing_identity(key.clone())
                .with_tokio()
                .with_other_transport(
                    |key| -> Result<
                        Boxed<(PeerId, StreamMuxerBox)>,
                        Box<dyn std::error::Error + Send + Sync>,
                    > {
                        use futures::future::Either;
                        let noise = noise::Config::new(key)?;
                        Ok(
                            tcp::tokio::Transport::new(tcp::Config::default().nodelay(true))
                                .map(move |socket, _| match half {
                                    Some(d) => Either::Left(crate::simdelay::DelayedStream::new(
                                        socket.0, d,
                                    )),
                                    None => Either::Right(socket),
                                })
                                .and_then(move |socket, _| async move {
                                    match psk {
                                        Some(psk) => libp2p::pnet::PnetConfig::new(psk)
                                            .handshake(socket)
                                            .await
                                            .map(Either::Left)
                                            .map_err(std::io::Error::other),
                                        None => Ok(Either::Right(socket)),
                                    }
                                })
                                .upgrade(Version::V1Lazy)
                                .authenticate(noise)
                                .multiplex(yamux::Config::default())
                                .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
                                .boxed(),
                        )
                    },
                )
                .map_err(|e| tr(&e))?
                .with_dns()
                .map_err(|e| tr(&e))?
                .with_relay_client(noise::Config::new, yamux::Config::default)
                .map_err(|e| tr(&e))?
                .with_bandwidth_metrics(&mut registry)
                .with_behaviour(|key, relay| {
                    behaviour::build(key, relay, cfg)
                        .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
                })
                .map_err(|e| tr(&e))?
                .with_swarm_config(|c| c.with_idle_connection_timeout(idle))
                .build();
            Ok(swarm)
        }
    }
}

/// Starts a listener on every address in `listen` and drives the swarm until each has reported
/// its address (within [`LISTEN_TIMEOUT`]). Returns the addresses actually bound (OS-chosen
/// ports filled in).
pub(super) async fn start_listening(
    swarm: &mut Swarm<Behaviour>,
    listen: &[Multiaddr],
) -> Result<Vec<Multiaddr>, NodeError> {
    let mut pending_listeners = HashSet::new();
    for addr in listen {
        let id = swarm
            .listen_on(addr.clone())
            .map_err(|e| NodeError::Listen {
                addr: addr.to_string(),
                reason: crate::error_chain(&e),
            })?;
        pending_listeners.insert(id);
    }
    let mut listen_addrs = Vec::new();
    let deadline = tokio::time::Instant::now() + LISTEN_TIMEOUT;
    while !pending_listeners.is_empty() {
        let event = tokio::time::timeout_at(deadline, swarm.select_next_some())
            .await
            .map_err(|_| NodeError::Timeout("waiting for listen addresses"))?;
        match event {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => {
                pending_listeners.remove(&listener_id);
                listen_addrs.push(address);
            }
            SwarmEvent::ListenerClosed {
                addresses, reason, ..
            } => {
                return Err(NodeError::Listen {
                    addr: format!("{addresses:?}"),
                    reason: match reason {
                        Ok(()) => "the listener closed".into(),
                        Err(e) => crate::error_chain(&e),
                    },
                })
            }
            SwarmEvent::ListenerError { error, .. } => {
                return Err(NodeError::Listen {
                    addr: format!("{listen:?}"),
                    reason: crate::error_chain(&error),
                })
            }
            _ => {}
        }
    }
    Ok(listen_addrs)
}

/// Whether `addr` is a QUIC (UDP) address.
pub(super) fn is_quic(addr: &Multiaddr) -> bool {
    addr.iter()
        .any(|p| matches!(p, Protocol::Udp(_) | Protocol::QuicV1 | Protocol::Quic))
}

/// The IP of a TCP listen address.
pub(super) fn tcp_ip(addr: &Multiaddr) -> Option<IpAddr> {
    tcp_socket(addr).map(|s| s.ip())
}

/// The IP and port of a TCP address (IP literals only).
pub(super) fn tcp_socket(addr: &Multiaddr) -> Option<SocketAddr> {
    let mut ip = None;
    for p in addr.iter() {
        match p {
            Protocol::Ip4(a) => ip = Some(IpAddr::V4(a)),
            Protocol::Ip6(a) => ip = Some(IpAddr::V6(a)),
            Protocol::Tcp(port) => return ip.map(|ip| SocketAddr::new(ip, port)),
            _ => {}
        }
    }
    None
}

/// The IP of a direct connection's remote address; `None` for relayed connections.
pub(super) fn direct_ip(addr: &Multiaddr) -> Option<IpAddr> {
    if addr.iter().any(|p| matches!(p, Protocol::P2pCircuit)) {
        return None;
    }
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(a) => Some(IpAddr::V4(a)),
        Protocol::Ip6(a) => Some(IpAddr::V6(a)),
        _ => None,
    })
}

/// The addresses among `announced` (a peer's listen addresses, from identify) that are on the IP
/// the peer's connection came from (`remote`): the ones worth giving Kademlia. A peer behind a
/// NAT announces private addresses that only its LAN can dial, and lookups that try them stall
/// on the dial timeout. Nothing for a relayed connection.
pub(super) fn on_remote_ip(announced: &[Multiaddr], remote: &Multiaddr) -> Vec<Multiaddr> {
    let Some(ip) = direct_ip(remote) else {
        return Vec::new();
    };
    announced
        .iter()
        .filter(|a| direct_ip(a) == Some(ip))
        .cloned()
        .collect()
}

/// The peer an address leads to: its last `/p2p/<peer id>` (in a relayed address
/// `<relay>/p2p/<relay id>/p2p-circuit/p2p/<peer id>`, the peer behind the relay), if any.
pub(super) fn peer_of(addr: &Multiaddr) -> Option<PeerId> {
    addr.iter()
        .filter_map(|p| match p {
            Protocol::P2p(id) => Some(id),
            _ => None,
        })
        .last()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quic_is_refused_where_it_would_bypass_the_key_or_the_delay() {
        let tcp: Multiaddr = "/ip4/127.0.0.1/tcp/0".parse().unwrap();
        let quic: Multiaddr = "/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap();
        let refusal =
            |cfg: &NodeConfig, listen: &[Multiaddr]| match check_private_swarm(cfg, listen) {
                Err(NodeError::Config(m)) => Some(m),
                Err(e) => panic!("unexpected error {e}"),
                Ok(()) => None,
            };
        let public = NodeConfig::default();
        assert_eq!(refusal(&public, &[tcp.clone(), quic.clone()]), None);
        let private = NodeConfig {
            swarm_key: Some(crate::SwarmKey::generate()),
            ..NodeConfig::default()
        };
        assert_eq!(refusal(&private, std::slice::from_ref(&tcp)), None);
        let m = refusal(&private, &[tcp.clone(), quic.clone()]).unwrap();
        assert!(m.contains("private swarm") && m.contains("quic-v1"), "{m}");
        let delayed = NodeConfig {
            simulated_rtt: Some(Duration::from_millis(50)),
            bootstrap: vec![quic.clone()],
            ..NodeConfig::default()
        };
        let m = refusal(&delayed, std::slice::from_ref(&tcp)).unwrap();
        assert!(m.contains("simulated round-trip"), "{m}");
        let both = NodeConfig {
            swarm_key: Some(crate::SwarmKey::generate()),
            ..delayed
        };
        let m = refusal(&both, &[tcp]).unwrap();
        assert!(m.contains("private swarm"), "{m}");
    }

    #[test]
    fn address_helpers_pick_the_right_parts() {
        let a: Multiaddr = "/ip4/10.0.0.1/tcp/4001".parse().unwrap();
        assert_eq!(tcp_ip(&a), Some("10.0.0.1".parse().unwrap()));
        assert_eq!(tcp_socket(&a), Some("10.0.0.1:4001".parse().unwrap()));
        let a6: Multiaddr = "/ip6/::1/tcp/4002".parse().unwrap();
        assert_eq!(tcp_socket(&a6), Some("[::1]:4002".parse().unwrap()));
        assert!(!is_quic(&a));
        let q: Multiaddr = "/ip4/10.0.0.1/udp/4001/quic-v1".parse().unwrap();
        assert!(is_quic(&q));
        assert_eq!(tcp_ip(&q), None);
        assert_eq!(tcp_socket(&q), None);
        let peer = PeerId::random();
        let relayed: Multiaddr = format!("/ip4/10.0.0.2/tcp/1/p2p/{peer}/p2p-circuit")
            .parse()
            .unwrap();
        assert_eq!(direct_ip(&relayed), None);
        assert_eq!(direct_ip(&a), Some("10.0.0.1".parse().unwrap()));
        assert_eq!(peer_of(&relayed), Some(peer));
        let behind = PeerId::random();
        let circuit = relayed.clone().with(Protocol::P2p(behind));
        assert_eq!(peer_of(&circuit), Some(behind));
        assert_eq!(peer_of(&a), None);
        let announced: Vec<Multiaddr> = ["/ip4/192.168.1.2/tcp/7", "/ip4/10.0.0.1/tcp/7"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let from: Multiaddr = "/ip4/10.0.0.1/tcp/50000".parse().unwrap();
        assert_eq!(on_remote_ip(&announced, &from), vec![announced[1].clone()]);
        let router: Multiaddr = "/ip4/10.0.0.9/tcp/50000".parse().unwrap();
        assert!(on_remote_ip(&announced, &router).is_empty());
        assert!(on_remote_ip(&announced, &relayed).is_empty());
    }
}
