//! Keeping the server visible and durable: DHT declarations renewed before they expire, and
//! periodic checkpoints.

use std::path::PathBuf;
use std::sync::Arc;

use starling_node::Node;
use tokio::sync::watch;
use tracing::{debug, warn};

use super::runtime::save_all;
use super::{ServerConfig, Shared};
use crate::grid::{ExpertHost, ExpertUid};

/// Declares every uid under every prefix, now and every `declare_every`.
pub(super) async fn declare_loop(
    node: Node,
    uids: Vec<String>,
    cfg: ServerConfig,
    mut stop: watch::Receiver<bool>,
) {
    let marker = node.owner_marker();
    let mut pairs: Vec<(String, String)> = uids
        .iter()
        .filter_map(|u| ExpertUid::parse(u).ok())
        .flat_map(|u| {
            (0..u.coords.len())
                .map(|l| u.declaration_at(l, &marker))
                .collect::<Vec<_>>()
        })
        .collect();
    pairs.sort();
    pairs.dedup();
    loop {
        let host = ExpertHost {
            peer: node.peer_id().to_bytes(),
            addrs: node
                .listen_addrs()
                .await
                .unwrap_or_default()
                .iter()
                .map(|a| a.to_string())
                .collect(),
        };
        let expiration = starling_dht::now_ms() + cfg.declare_ttl.as_millis() as u64;
        let puts = pairs.iter().map(|(key, sub)| {
            let node = node.clone();
            let host = host.clone();
            async move { node.store(key, sub, &host, expiration).await }
        });
        let results = tokio::select! {
            r = futures::future::join_all(puts) => r,
            _ = stop.changed() => return,
        };
        let failed = results.iter().filter(|r| r.is_err()).count();
        if failed > 0 {
            debug!(
                failed,
                total = pairs.len(),
                "some expert declarations failed"
            );
        }
        tokio::select! {
            _ = tokio::time::sleep(cfg.declare_every) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Checkpoints every expert into `dir` every `checkpoint_every` until `stop`.
pub(super) async fn checkpoint_loop(
    shared: Arc<Shared>,
    dir: PathBuf,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(shared.cfg.checkpoint_every) => {}
            _ = stop.changed() => return,
        }
        if let Err(e) = save_all(&shared, dir.clone()).await {
            warn!("periodic checkpoint failed: {e}");
        }
    }
}
