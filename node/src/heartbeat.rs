//! Heartbeats: each node keeps a small owner-signed record of itself in the DHT, from which
//! anyone can list the live swarm (`starling status`, the dashboard).
//!
//! A heartbeat lives under one DHT key ([`HEARTBEAT_KEY`]) in the sub-key that is the node's
//! owner marker, so only that node can write it (the DHT checks the ed25519 signature), and a
//! reader checks that the marker's key is the peer the heartbeat claims to be
//! ([`read_heartbeats`]). Each expires after [`HeartbeatConfig::ttl`] and is renewed every
//! [`HeartbeatConfig::interval`]: a node that stops drops out of the list within one TTL.
//!
//! ```no_run
//! # async fn demo(node: starling_node::Node) -> Result<(), starling_node::NodeError> {
//! use starling_node::heartbeat::{read_heartbeats, HeartbeatConfig, HeartbeatTask};
//! let task = HeartbeatTask::spawn(&node, HeartbeatConfig::default());
//! for hb in read_heartbeats(&node, &HeartbeatConfig::default()).await? {
//!     println!("{} {:?} {}", hb.peer_id, hb.mode, hb.version);
//! }
//! task.stop().await;
//! # Ok(()) }
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};
use starling_dht::now_ms;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::board::Board;
use crate::{Node, NodeError, Reachability};

/// The DHT key every node's heartbeat lives under. Version 2: the board's sections
/// ([`crate::board`]) replaced the fixed bandwidth, training and experts fields of version 1
/// (`starling.heartbeat`); nodes of either version list only their own version's heartbeats
/// instead of misreading the other's.
pub const HEARTBEAT_KEY: &str = "starling.heartbeat.v2";

/// Longest version string a reader keeps of a heartbeat (bytes); longer ones are cut. (The
/// peer id is checked against the signing key, and the board is bounded by
/// [`Board::within_bounds`].)
pub const MAX_FIELD_LEN: usize = 128;

/// How a node takes part in the swarm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A full node: accepts connections, serves the DHT, can reduce.
    Node,
    /// A client: dials out only (client mode, or behind a NAT).
    Client,
}

/// What a node tells the swarm about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The node's peer id (checked against the signing key by [`read_heartbeats`]).
    pub peer_id: String,
    /// The software version (`starling/<version>`).
    pub version: String,
    /// Node or client.
    pub mode: Mode,
    /// Reachability as autonat sees it.
    pub reachability: Reachability,
    /// Peers connected when the heartbeat was sent.
    pub connected_peers: usize,
    /// What the components running on the node say of it (bandwidth, training progress,
    /// experts hosted), read with [`Board::get`] and the components' section types.
    pub board: Board,
    /// When the heartbeat was sent (unix ms).
    pub time_ms: u64,
    /// When it expires (unix ms); filled in by [`read_heartbeats`] from the DHT entry.
    #[serde(default)]
    pub expires_ms: u64,
}

/// How often heartbeats are sent and how long each lives.
#[derive(Debug, Clone)]
pub struct HeartbeatConfig {
    /// DHT key (default [`HEARTBEAT_KEY`]); a test may use its own.
    pub key: String,
    /// Time between heartbeats (default 10 s).
    pub interval: Duration,
    /// How long each heartbeat lives (default 30 s): a stopped node disappears within it.
    pub ttl: Duration,
    /// Bound on one DHT write or read (default 10 s).
    pub timeout: Duration,
}

impl Default for HeartbeatConfig {
    fn default() -> Self {
        HeartbeatConfig {
            key: HEARTBEAT_KEY.to_string(),
            interval: Duration::from_secs(10),
            ttl: Duration::from_secs(30),
            timeout: Duration::from_secs(10),
        }
    }
}

impl HeartbeatConfig {
    /// A shorter interval and TTL (the TTL stays three intervals), for tests and demos.
    ///
    /// ```
    /// use std::time::Duration;
    /// let cfg = starling_node::heartbeat::HeartbeatConfig::default().every(Duration::from_secs(1));
    /// assert_eq!(cfg.ttl, Duration::from_secs(3));
    /// ```
    pub fn every(mut self, interval: Duration) -> Self {
        self.interval = interval.max(Duration::from_millis(100));
        self.ttl = self.interval * 3;
        self
    }
}

/// This node's heartbeat now: its status and its board (see [`crate::board`]).
pub async fn current(node: &Node) -> Result<Heartbeat, NodeError> {
    let status = node.status().await?;
    let board = node.metrics().board();
    let mode = match status.reachability {
        Reachability::Client | Reachability::Private => Mode::Client,
        _ => Mode::Node,
    };
    Ok(Heartbeat {
        peer_id: status.peer_id,
        version: format!("starling/{}", env!("CARGO_PKG_VERSION")),
        mode,
        reachability: status.reachability,
        connected_peers: status.connected_peers,
        board,
        time_ms: now_ms(),
        expires_ms: 0,
    })
}

/// Publishes this node's heartbeat once.
pub async fn publish(node: &Node, cfg: &HeartbeatConfig) -> Result<(), NodeError> {
    let hb = current(node).await?;
    let expires = now_ms() + cfg.ttl.as_millis() as u64;
    let stored = tokio::time::timeout(
        cfg.timeout,
        node.store(&cfg.key, &node.owner_marker(), &hb, expires),
    )
    .await
    .map_err(|_| NodeError::Timeout("publishing a heartbeat"))?;
    match stored {
        // Stored locally, no peer acknowledged yet (a lone first node): others read it from us.
        Ok(_) | Err(NodeError::QuorumFailed { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Every live node's heartbeat, sorted by peer id: only entries whose sub-key is the owner
/// marker of the peer the heartbeat names (the DHT accepted them only with that owner's
/// signature). Forged or malformed entries are dropped.
pub async fn read_heartbeats(
    node: &Node,
    cfg: &HeartbeatConfig,
) -> Result<Vec<Heartbeat>, NodeError> {
    let entries = tokio::time::timeout(cfg.timeout, node.get::<Heartbeat>(&cfg.key))
        .await
        .map_err(|_| NodeError::Timeout("reading heartbeats"))??;
    let mut beats: Vec<Heartbeat> = entries
        .into_iter()
        .filter_map(|(subkey, mut hb, expires)| {
            let owner = starling_dht::required_owner(&cfg.key, &subkey).ok()??;
            let peer = crate::peer_id_of_owner(&owner)?;
            if peer.to_string() != hb.peer_id {
                tracing::debug!(%peer, claimed = %hb.peer_id, "heartbeat for another peer dropped");
                return None;
            }
            hb.expires_ms = expires;
            hb.version = crate::board::cut(&hb.version, MAX_FIELD_LEN);
            hb.board = hb.board.within_bounds();
            Some(hb)
        })
        .collect();
    beats.sort_by(|a, b| a.peer_id.cmp(&b.peer_id));
    Ok(beats)
}

/// The background task that keeps a node's heartbeat fresh. Stops on [`HeartbeatTask::stop`],
/// when dropped, or when the node shuts down.
#[derive(Debug)]
pub struct HeartbeatTask {
    stop: watch::Sender<bool>,
    handle: Option<JoinHandle<()>>,
}

impl HeartbeatTask {
    /// Publishes `node`'s heartbeat now and every `cfg.interval` after. See the
    /// [module docs](self).
    pub fn spawn(node: &Node, cfg: HeartbeatConfig) -> HeartbeatTask {
        let (stop, mut stopped) = watch::channel(false);
        let node = node.clone();
        let span = node.span();
        let handle = tokio::spawn(
            async move {
                let mut tick = tokio::time::interval(cfg.interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = stopped.changed() => break,
                        _ = node.closed() => break,
                    }
                    let beat = publish(&node, &cfg);
                    tokio::select! {
                        r = beat => if let Err(e) = r {
                            tracing::debug!("heartbeat not published: {e}");
                        },
                        _ = stopped.changed() => break,
                        _ = node.closed() => break,
                    }
                }
                tracing::debug!("heartbeat stopped");
            }
            .instrument(span),
        );
        HeartbeatTask {
            stop,
            handle: Some(handle),
        }
    }

    /// Stops the task and waits until it has.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(h) = self.handle.take() {
            let _ = h.await;
        }
    }
}

impl Drop for HeartbeatTask {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NodeConfig;

    #[tokio::test]
    async fn a_node_reads_its_own_heartbeat_with_its_board() {
        let cfg = NodeConfig::default().listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap());
        let node = Node::start(cfg).await.unwrap();
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct Progress {
            run: String,
            epoch: u64,
        }
        impl crate::board::Section for Progress {
            const NAME: &'static str = "progress";
            const VERSION: u32 = 1;
        }
        let mine = Progress {
            run: "x".repeat(1000),
            epoch: 3,
        };
        node.metrics().set_section(&mine);
        let hb_cfg = HeartbeatConfig::default().every(Duration::from_millis(200));
        let task = HeartbeatTask::spawn(&node, hb_cfg.clone());
        let beats = loop {
            let beats = read_heartbeats(&node, &hb_cfg).await.unwrap();
            if !beats.is_empty() {
                break beats;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        task.stop().await;
        assert_eq!(beats.len(), 1);
        let hb = &beats[0];
        assert_eq!(hb.peer_id, node.peer_id().to_string());
        assert_eq!(hb.board.get::<Progress>(), Some(mine));
        assert!(hb.expires_ms > hb.time_ms);
        node.shutdown().await;
    }
}
