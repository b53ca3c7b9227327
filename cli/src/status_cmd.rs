//! `starling status`: joins the swarm briefly as a client, reads every node's heartbeat
//! ([`starling_node::heartbeat`]) and prints the live swarm as a table or JSON.

use anyhow::{bail, Result};
use clap::Args;
use starling_node::heartbeat::{read_heartbeats, HeartbeatConfig};
use starling_node::Node;

use crate::observe::peer::PeerView;
use crate::JoinArgs;

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Print one JSON object (`{"peers": [...]}`) instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    join: JoinArgs,
}

pub async fn run(args: StatusArgs) -> Result<()> {
    if args.join.bootstrap.is_empty() {
        bail!("--bootstrap is required: give the address of a running node (it prints its addresses at start)");
    }
    let mut cfg = args.join.config()?.client(true);
    cfg.fast_lane = false;
    let hb = HeartbeatConfig {
        timeout: cfg.request_timeout * 2,
        ..HeartbeatConfig::default()
    };
    let node = Node::start(cfg).await?;
    let read = read_heartbeats(&node, &hb).await;
    node.shutdown().await;
    let peers: Vec<PeerView> = read?.iter().map(PeerView::from).collect();
    if args.json {
        println!("{}", serde_json::json!({ "peers": peers }));
    } else {
        print!("{}", table(&peers));
    }
    Ok(())
}

/// Bytes per second in words.
fn rate(bytes_per_second: f64) -> String {
    if !(bytes_per_second.is_finite() && bytes_per_second > 0.0) {
        return "-".into();
    }
    let mut v = bytes_per_second;
    for unit in ["B/s", "KB/s", "MB/s", "GB/s"] {
        if v < 1000.0 {
            return format!("{v:.1} {unit}");
        }
        v /= 1000.0;
    }
    format!("{v:.1} TB/s")
}

/// The swarm as a text table, one line per peer.
fn table(peers: &[PeerView]) -> String {
    let mut rows = vec![[
        "PEER".to_string(),
        "MODE".into(),
        "REACH".into(),
        "CONNS".into(),
        "BANDWIDTH".into(),
        "RUN".into(),
        "EPOCH".into(),
        "SAMPLES/S".into(),
        "LOSS".into(),
        "EXPERTS".into(),
        "VERSION".into(),
    ]];
    for p in peers {
        let t = p.training.as_ref();
        rows.push([
            p.peer_id.clone(),
            format!("{:?}", p.mode).to_lowercase(),
            format!("{:?}", p.reachability).to_lowercase(),
            p.connected_peers.to_string(),
            rate(p.bandwidth),
            t.map_or("-".into(), |t| t.run.clone()),
            t.map_or("-".into(), |t| t.epoch.to_string()),
            t.map_or("-".into(), |t| format!("{:.1}", t.samples_per_second)),
            t.and_then(|t| t.loss)
                .map_or("-".into(), |l| format!("{l:.4}")),
            p.experts_total.to_string(),
            p.version.clone(),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out.push_str(&format!("{} live peer(s)\n", peers.len()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_in_units() {
        assert_eq!(rate(0.0), "-");
        assert_eq!(rate(f64::NAN), "-");
        assert_eq!(rate(1500.0), "1.5 KB/s");
        assert_eq!(rate(2.5e8), "250.0 MB/s");
    }

    #[test]
    fn an_empty_swarm_is_a_header_and_a_count() {
        let t = table(&[]);
        assert!(t.starts_with("PEER"));
        assert!(t.ends_with("0 live peer(s)\n"));
    }
}
