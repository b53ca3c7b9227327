//! Many nodes in one process on 127.0.0.1, for benchmarks, demos and tests.

use tracing::Instrument;

use crate::{Node, NodeConfig, NodeError};

/// A swarm of nodes on loopback: the first node is the bootstrap peer of all others.
///
/// ```no_run
/// # async fn demo() -> Result<(), starling_node::NodeError> {
/// use starling_node::{cluster::LocalCluster, NodeConfig};
/// let cluster = LocalCluster::start(8, NodeConfig::default()).await?;
/// assert_eq!(cluster.nodes.len(), 8);
/// cluster.shutdown().await;
/// # Ok(()) }
/// ```
pub struct LocalCluster {
    /// The running nodes; `nodes[0]` is the bootstrap peer.
    pub nodes: Vec<Node>,
}

impl LocalCluster {
    /// Starts `n` nodes listening on `127.0.0.1` (TCP, OS-chosen ports), each built from
    /// `template` (its listen and bootstrap lists are replaced), and refreshes every routing table
    /// once all have joined.
    pub async fn start(n: usize, template: NodeConfig) -> Result<Self, NodeError> {
        let mut nodes = Vec::with_capacity(n);
        let mut template = template;
        template.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().expect("valid multiaddr")];
        template.bootstrap.clear();
        template.identity = None;
        template.identity_file = None;
        if n == 0 {
            return Ok(LocalCluster { nodes });
        }
        let first = Node::start(template.clone()).await?;
        let boot = first
            .listen_addrs()
            .await?
            .into_iter()
            .next()
            .ok_or(NodeError::Config("bootstrap node has no address".into()))?;
        nodes.push(first);
        let mut joiners = Vec::new();
        for _ in 1..n {
            let cfg = template.clone().bootstrap_from(boot.clone());
            joiners.push(tokio::spawn(Node::start(cfg).in_current_span()));
        }
        for j in joiners {
            let node = j
                .await
                .map_err(|e| NodeError::Config(format!("node task failed: {e}")))??;
            nodes.push(node);
        }
        let refreshes = nodes.iter().map(|n| n.bootstrap());
        for r in futures::future::join_all(refreshes).await {
            if let Err(e) = r {
                tracing::debug!("routing refresh: {e}");
            }
        }
        Ok(LocalCluster { nodes })
    }

    /// Shuts every node down.
    pub async fn shutdown(self) {
        futures::future::join_all(self.nodes.iter().map(|n| n.shutdown())).await;
    }
}
