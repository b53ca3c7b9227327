//! Reaching a given peer: [`Node::connect_if_needed`], which also finds peers down when every
//! direct TCP address refuses (see [`crate::down`]).

use libp2p::{Multiaddr, PeerId};

use super::actor::Command;
use super::Node;
use crate::NodeError;

/// What one dial of [`Node::connect_if_needed`] found.
#[derive(Debug, PartialEq, Eq)]
enum Dialed {
    Reached,
    /// Nothing listens there (the host answered with a reset).
    Refused,
    Failed,
}

impl Node {
    /// Makes sure a connection to `peer` is open: returns at once when one is, else dials
    /// `addrs` until one reaches that peer (each dial bounded by the node's request timeout),
    /// its direct TCP addresses first. Returns whether the peer is connected afterwards; a
    /// failed dial is not an error, because libp2p may still reach the peer another way (a
    /// relay, other addresses). When every direct TCP address refuses the connection, the
    /// peer is taken as down ([`Self::is_down`]: nothing listens where it did) and its other
    /// addresses are not tried: a QUIC dial to a dead peer can only time out.
    ///
    /// ```no_run
    /// # async fn demo(node: starling_node::Node, peer: starling_node::PeerId, addr: starling_node::Multiaddr) -> Result<(), starling_node::NodeError> {
    /// if !node.connect_if_needed(peer, &[addr]).await? {
    ///     eprintln!("{peer} is not directly reachable");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn connect_if_needed(
        &self,
        peer: PeerId,
        addrs: &[Multiaddr],
    ) -> Result<bool, NodeError> {
        if self.connected_peers().await?.contains(&peer) {
            return Ok(true);
        }
        if self.is_down(&peer) {
            return Ok(false);
        }
        let tcp = crate::down::probe_addrs(addrs);
        let mut refused = 0;
        for addr in &tcp {
            match self.dial_for(peer, addr).await? {
                Dialed::Reached => return Ok(true),
                Dialed::Refused => refused += 1,
                Dialed::Failed => {}
            }
        }
        if refused > 0 && refused == tcp.len() {
            self.call(|done| Command::MarkDown(peer, done)).await?;
            return Ok(false);
        }
        for addr in addrs.iter().filter(|a| !tcp.contains(a)) {
            if self.dial_for(peer, addr).await? == Dialed::Reached {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// One dial of [`Self::connect_if_needed`]: whether `addr` reached `peer`.
    async fn dial_for(&self, peer: PeerId, addr: &Multiaddr) -> Result<Dialed, NodeError> {
        match self.dial(addr.clone()).await {
            Ok(reached) if reached == peer => Ok(Dialed::Reached),
            Ok(reached) => {
                tracing::debug!(%peer, %reached, %addr, "address reached another peer");
                Ok(Dialed::Failed)
            }
            Err(NodeError::Closed) => Err(NodeError::Closed),
            Err(e) => {
                tracing::debug!(%peer, %addr, "dial failed: {e}");
                // (The transport's error comes as text here.)
                let refused = e
                    .to_string()
                    .to_ascii_lowercase()
                    .contains("connection refused");
                Ok(if refused {
                    Dialed::Refused
                } else {
                    Dialed::Failed
                })
            }
        }
    }
}
