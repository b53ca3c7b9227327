use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use starling_averager::local::DeviceReport;
use starling_node::{Multiaddr, Node};

use crate::JoinArgs;

#[derive(Args, Debug)]
pub struct NodeArgs {
    #[command(flatten)]
    join: JoinArgs,
    /// Address to listen on. Repeatable. Default: TCP (and QUIC in public swarms) on all
    /// interfaces with OS-chosen ports.
    #[arg(long, value_name = "MULTIADDR")]
    listen: Vec<Multiaddr>,
    /// Client mode: accept no inbound connections (behind NAT, or by choice).
    #[arg(long)]
    client: bool,
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
}

pub async fn run(args: NodeArgs) -> Result<()> {
    let devices = DeviceReport::probe();
    if args.gpus {
        println!("{devices}");
        return Ok(());
    }
    let mut cfg = args.join.config()?;
    cfg.listen = args.listen.clone();
    cfg.client_mode = args.client;
    let private = cfg.swarm_key.map(|k| k.fingerprint());
    let node = Node::start(cfg).await?;
    println!("peer id: {}", node.peer_id());
    match &private {
        Some(fp) => println!("private swarm (key fingerprint {fp}): TCP only"),
        None => println!("public swarm"),
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
    println!("{devices}");
    let mut tick = tokio::time::interval(Duration::from_secs(args.status_interval.max(1)));
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = terminate() => break,
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
    node.shutdown().await;
    Ok(())
}

/// Listen addresses with loopback ones last: the first printed is one that other machines can
/// dial (what users copy, and what scripts take), where there is one.
fn reachable_first(mut addrs: Vec<Multiaddr>) -> Vec<Multiaddr> {
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
