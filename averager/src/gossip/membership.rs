//! Who gossips: declarations under `{prefix}.gossip` (one owner-signed sub-key per peer, with
//! the membership TTL as expiration), the live view built from them (sorted peer ids give
//! ranks), and the back-off table of neighbours that failed.

use std::collections::HashMap;
use std::time::Duration;

use starling_node::{Multiaddr, Node, NodeError, PeerId};
use tokio::time::{timeout, Instant};

use crate::wire::GossipDeclaration;
use crate::AveragerError;

/// Peers remembered in the back-off table, at most.
const MAX_BACKOFF_ENTRIES: usize = 4096;
/// Members read from the DHT, at most (the DHT bounds sub-keys per key too).
pub(crate) const MAX_MEMBERS: usize = 4096;

/// A live member.
#[derive(Debug, Clone)]
pub(crate) struct Member {
    pub peer: PeerId,
    pub addrs: Vec<Multiaddr>,
}

/// The DHT key peers of `prefix` declare under.
pub(crate) fn key(prefix: &str) -> String {
    format!("{prefix}.gossip")
}

/// Declares this peer under `key` until now + `ttl`, bounded by `limit`.
pub(crate) async fn declare(
    node: &Node,
    key: &str,
    schema: u64,
    ttl: Duration,
    limit: Duration,
) -> Result<(), AveragerError> {
    let addrs = node
        .listen_addrs()
        .await?
        .iter()
        .map(|a| a.to_string())
        .collect();
    let decl = GossipDeclaration {
        peer_id: node.peer_id().to_bytes(),
        addrs,
        schema,
    };
    let expires = starling_dht::now_ms() + ttl.as_millis() as u64;
    // Under our owner marker: signed by the node, so nobody else can overwrite it.
    match timeout(limit, node.store(key, &node.owner_marker(), &decl, expires)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(NodeError::Closed)) => Err(NodeError::Closed.into()),
        Ok(Err(e)) => {
            tracing::debug!("declaring under {key}: {e}");
            Ok(())
        }
        Err(_) => {
            tracing::debug!("declaring under {key} timed out");
            Ok(())
        }
    }
}

/// The live members under `key` with schema `schema`, written by the peers they declare, sorted
/// by peer id bytes (ranks), `me` always included; `None` if the lookup failed.
pub(crate) async fn read(
    node: &Node,
    key: &str,
    schema: u64,
    limit: Duration,
) -> Result<Option<Vec<Member>>, AveragerError> {
    let entries = match timeout(limit, node.get::<GossipDeclaration>(key)).await {
        Ok(Ok(e)) => e,
        Ok(Err(NodeError::Closed)) => return Err(NodeError::Closed.into()),
        _ => return Ok(None),
    };
    let me = node.peer_id();
    let mut members: Vec<Member> = entries
        .into_iter()
        .filter(|(subkey, d, _)| d.schema == schema && declared_by_its_peer(key, subkey, d))
        .filter_map(|(_, d, _)| {
            let peer = PeerId::from_bytes(&d.peer_id).ok()?;
            let addrs = d.addrs.iter().filter_map(|a| a.parse().ok()).collect();
            Some(Member { peer, addrs })
        })
        .filter(|m| m.peer != me)
        .take(MAX_MEMBERS)
        .collect();
    members.push(Member {
        peer: me,
        addrs: Vec::new(),
    });
    members.sort_by_key(|m| m.peer.to_bytes());
    members.dedup_by_key(|m| m.peer);
    Ok(Some(members))
}

/// Whether a declaration under `(key, subkey)` was written by the peer it names: the sub-key is
/// an owner marker (the DHT holds it only with that owner's valid signature) of that peer.
fn declared_by_its_peer(key: &str, subkey: &str, d: &GossipDeclaration) -> bool {
    let Ok(Some(owner)) = starling_dht::required_owner(key, subkey) else {
        return false;
    };
    let declared = PeerId::from_bytes(&d.peer_id).ok();
    declared.is_some() && starling_node::peer_id_of_owner(&owner) == declared
}

/// Neighbours that failed, skipped until their back-off ends (doubling per failure).
#[derive(Debug, Default)]
pub(crate) struct Backoff {
    entries: HashMap<PeerId, (Instant, u32)>,
}

impl Backoff {
    /// Records a failure of `peer`: skip it for `base * 2^(failures - 1)`, at most `max`.
    pub fn fail(&mut self, peer: PeerId, base: Duration, max: Duration, now: Instant) {
        if self.entries.len() >= MAX_BACKOFF_ENTRIES {
            self.entries.retain(|_, (until, _)| *until > now);
        }
        if self.entries.len() >= MAX_BACKOFF_ENTRIES && !self.entries.contains_key(&peer) {
            return;
        }
        let failures = self.entries.get(&peer).map_or(0, |e| e.1) + 1;
        let wait = base
            .checked_mul(1u32 << (failures - 1).min(16))
            .unwrap_or(max)
            .min(max);
        self.entries.insert(peer, (now + wait, failures));
    }

    /// `peer` answered: forget its failures.
    pub fn ok(&mut self, peer: &PeerId) {
        self.entries.remove(peer);
    }

    /// Whether `peer` is being skipped at `now`.
    pub fn skipped(&self, peer: &PeerId, now: Instant) -> bool {
        self.entries
            .get(peer)
            .is_some_and(|(until, _)| *until > now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_ends() {
        let mut b = Backoff::default();
        let p = PeerId::random();
        let (base, max) = (Duration::from_secs(1), Duration::from_secs(3));
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        b.fail(p, base, max, t0);
        assert!(b.skipped(&p, at(900)));
        assert!(!b.skipped(&p, at(1100)));
        b.fail(p, base, max, at(1100)); // second failure: 2 s
        assert!(b.skipped(&p, at(3000)));
        assert!(!b.skipped(&p, at(3200)));
        b.fail(p, base, max, at(3200)); // third: 4 s, capped at 3 s
        assert!(b.skipped(&p, at(6100)));
        assert!(!b.skipped(&p, at(6300)));
        b.ok(&p);
        assert!(!b.skipped(&p, t0));
    }

    #[test]
    fn only_declarations_under_the_declared_peers_marker_count() {
        use starling_node::{owner_key_of, Keypair};
        let alice = Keypair::generate_ed25519();
        let mallory = Keypair::generate_ed25519();
        let d = GossipDeclaration {
            peer_id: alice.public().to_peer_id().to_bytes(),
            addrs: vec![],
            schema: 1,
        };
        let alice_marker = owner_key_of(&alice).unwrap().marker();
        let mallory_marker = owner_key_of(&mallory).unwrap().marker();
        assert!(declared_by_its_peer("run.gossip", &alice_marker, &d));
        assert!(!declared_by_its_peer("run.gossip", &mallory_marker, &d));
        assert!(!declared_by_its_peer("run.gossip", "plain", &d));
    }
}
