use std::time::Duration;

use anyhow::Result;
use clap::Args;
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
}

pub async fn run(args: NodeArgs) -> Result<()> {
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
    let addrs = node.listen_addrs().await?;
    if addrs.is_empty() {
        println!("client mode: not listening");
    }
    for a in addrs {
        println!("listening on {a}");
    }
    if let Some(port) = node.fast_lane_port() {
        println!("fast lane on TCP port {port} (open it in firewalls for full averaging speed)");
    }
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
