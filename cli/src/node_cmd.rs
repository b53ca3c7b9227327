use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use starling_averager::devices::DeviceReport;
use starling_node::{Multiaddr, NatEvent, Node, Reachability, RelayServerConfig};
use tokio::sync::broadcast;

use crate::observe::{ObserveArgs, Observer};
use crate::{JoinArgs, ListenArgs, NatArgs};

/// How long `--dial` waits for autonat's verdict before dialing anyway.
const DIAL_AFTER_AT_MOST: Duration = Duration::from_secs(120);
/// How often `--dial` tries each address, and the pause between tries (the peer may not have
/// its relay reservation yet).
const DIAL_ATTEMPTS: u32 = 10;
const DIAL_PAUSE: Duration = Duration::from_secs(3);

#[derive(Args, Debug)]
pub struct NodeArgs {
    #[command(flatten)]
    join: JoinArgs,
    #[command(flatten)]
    nat: NatArgs,
    #[command(flatten)]
    listen: ListenArgs,
    /// Serve as a circuit relay (v2) for peers behind NATs. The relay hands out reservations
    /// once it has a confirmed public address: give it with --external, or let autonat find it.
    #[arg(long)]
    relay: bool,
    /// Relay reservations held at once, over all peers (with --relay).
    #[arg(long, default_value_t = 128)]
    relay_max_reservations: usize,
    /// Peer to connect to once autonat has judged this node's reachability. A `/p2p-circuit`
    /// address reaches a peer behind a NAT through its relay; dcutr then tries to punch a hole
    /// for a direct connection, and the outcome is printed. Repeatable.
    #[arg(long, value_name = "MULTIADDR")]
    dial: Vec<Multiaddr>,
    /// Seconds between status lines.
    #[arg(long, default_value_t = 10)]
    status_interval: u64,
    /// Print status lines as JSON objects instead of text.
    #[arg(long)]
    json: bool,
    /// Print the local devices found (GPUs, NCCL; or why there are none) and exit. A node
    /// always prints this one line when it starts.
    #[arg(long)]
    gpus: bool,
    #[command(flatten)]
    observe: ObserveArgs,
}

pub async fn run(args: NodeArgs) -> Result<()> {
    let devices = DeviceReport::probe();
    if args.gpus {
        println!("{devices}");
        return Ok(());
    }
    let mut cfg = args.join.config()?;
    args.listen.apply(&mut cfg);
    args.nat.apply(&mut cfg);
    if args.relay {
        cfg.relay_server = Some(RelayServerConfig {
            max_reservations: args.relay_max_reservations,
            ..RelayServerConfig::default()
        });
    }
    let private = cfg.swarm_key.map(|k| k.fingerprint());
    let node = Node::start(cfg).await?;
    let mut nat_events = node.nat_events();
    println!("peer id: {}", node.peer_id());
    match &private {
        Some(fp) => println!("private swarm (key fingerprint {fp}): TCP only"),
        None => println!("public swarm"),
    }
    if args.relay {
        println!(
            "relay server: at most {} reservations",
            args.relay_max_reservations
        );
    }
    let addrs = reachable_first(node.listen_addrs().await?);
    if addrs.is_empty() {
        println!("client mode: not listening");
    }
    for a in addrs {
        println!("listening on {a}");
    }
    if let Some(port) = node.fast_lane_port() {
        println!(
            "fast lane on TCP port {port} ({}; open it in firewalls for full averaging speed)",
            lane_where(&node.fast_lane_addrs())
        );
    }
    if !args.dial.is_empty() {
        tokio::spawn(dial_when_judged(node.clone(), args.dial.clone()));
    }
    println!("{devices}");
    let observer = Observer::start(&node, &args.observe).await?;
    observer.print(args.json);
    let mut tick = tokio::time::interval(Duration::from_secs(args.status_interval.max(1)));
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = terminate() => break,
            event = nat_events.recv() => print_nat_event(event, args.json)?,
            _ = tick.tick() => {
                let s = node.status().await?;
                if args.json {
                    println!("{}", serde_json::to_string(&s)?);
                } else {
                    println!(
                        "peers {} | routing table {} | records {} ({} B) | rejected {} | reachability {:?}",
                        s.connected_peers, s.routing_table, s.records, s.record_bytes, s.rejected_records, s.reachability
                    );
                }
            }
        }
    }
    println!("shutting down");
    observer.stop().await;
    node.shutdown().await;
    Ok(())
}

/// Listen addresses with loopback ones last: the first printed is one that other machines can
/// dial (what users copy, and what scripts take), where there is one.
pub(crate) fn reachable_first(mut addrs: Vec<Multiaddr>) -> Vec<Multiaddr> {
    // `/ip4/<ip>/...` or `/ip6/<ip>/...`
    let loopback = |a: &Multiaddr| {
        let text = a.to_string();
        let mut parts = text.split('/').skip(1);
        matches!(parts.next(), Some("ip4" | "ip6"))
            && parts
                .next()
                .and_then(|ip| ip.parse::<IpAddr>().ok())
                .is_some_and(|ip| ip.is_loopback())
    };
    addrs.sort_by_key(loopback); // stable: TCP before QUIC stays
    addrs
}

/// Where the fast lane listens, in words.
fn lane_where(addrs: &[SocketAddr]) -> String {
    if addrs.iter().any(|a| a.ip().is_unspecified()) {
        return "all interfaces".into();
    }
    let ips: Vec<String> = addrs.iter().map(|a| a.ip().to_string()).collect();
    ips.join(", ")
}

/// Prints one NAT event as a line (a `{"nat": line}` object with `--json`).
fn print_nat_event(event: Result<NatEvent, broadcast::error::RecvError>, json: bool) -> Result<()> {
    let line = match event {
        Ok(e) => e.to_string(),
        Err(broadcast::error::RecvError::Lagged(n)) => format!("({n} NAT events not shown)"),
        // The node stopped; the status tick reports that.
        Err(broadcast::error::RecvError::Closed) => return Ok(()),
    };
    if json {
        println!("{}", serde_json::json!({ "nat": line }));
    } else {
        println!("{line}");
    }
    Ok(())
}

/// Waits (boundedly) for autonat's verdict, so that the relayed connection a dial may open
/// carries this node's observed addresses for hole punching, then dials each address until it
/// connects. Prints one line per address.
async fn dial_when_judged(node: Node, addrs: Vec<Multiaddr>) {
    let deadline = tokio::time::Instant::now() + DIAL_AFTER_AT_MOST;
    while tokio::time::Instant::now() < deadline {
        match node.status().await {
            Ok(s) if s.reachability != Reachability::Unknown => break,
            Ok(_) => tokio::time::sleep(Duration::from_millis(250)).await,
            Err(_) => return,
        }
    }
    for addr in addrs {
        let relayed = addr.to_string().contains("/p2p-circuit");
        let how = if relayed {
            "through a relay"
        } else {
            "directly"
        };
        let mut last_error = String::new();
        for attempt in 0..DIAL_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(DIAL_PAUSE).await;
            }
            match node.dial(addr.clone()).await {
                Ok(peer) => {
                    println!("connected to {peer} {how}");
                    last_error.clear();
                    break;
                }
                Err(e) => last_error = e.to_string(),
            }
        }
        if !last_error.is_empty() {
            println!("could not dial {addr}: {last_error}");
        }
    }
}

#[cfg(unix)]
pub async fn terminate() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut s) => {
            s.recv().await;
        }
        Err(_) => futures::future::pending::<()>().await,
    }
}

#[cfg(not(unix))]
pub async fn terminate() {
    futures::future::pending::<()>().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dialable_addresses_are_printed_before_loopback_ones() {
        let a = |s: &str| s.parse::<Multiaddr>().unwrap();
        let sorted = reachable_first(vec![
            a("/ip4/127.0.0.1/tcp/1"),
            a("/ip4/10.0.0.2/tcp/1"),
            a("/ip6/::1/tcp/1"),
            a("/ip4/127.0.0.1/udp/2/quic-v1"),
            a("/ip4/10.0.0.2/udp/2/quic-v1"),
        ]);
        assert_eq!(
            sorted,
            vec![
                a("/ip4/10.0.0.2/tcp/1"),
                a("/ip4/10.0.0.2/udp/2/quic-v1"),
                a("/ip4/127.0.0.1/tcp/1"),
                a("/ip6/::1/tcp/1"),
                a("/ip4/127.0.0.1/udp/2/quic-v1"),
            ]
        );
        let s = |v: &str| v.parse::<SocketAddr>().unwrap();
        assert_eq!(lane_where(&[s("0.0.0.0:5")]), "all interfaces");
        assert_eq!(
            lane_where(&[s("10.0.0.2:5"), s("[::1]:5")]),
            "10.0.0.2, ::1"
        );
    }
}
