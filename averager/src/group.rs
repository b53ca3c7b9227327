//! A formed group as the rest of the crate sees it: members with their peer ids and addresses
//! parsed once, when matchmaking accepts the member list.

use starling_node::{Multiaddr, PeerId};

use crate::config::AveragingMode;
use crate::wire::{MemberIdx, MemberInfo};

/// A member of a formed group, its peer id and addresses parsed once.
#[derive(Debug, Clone)]
pub(crate) struct Member {
    pub peer: PeerId,
    /// Addresses it can be dialed at (those that parse; empty for clients).
    pub addrs: Vec<Multiaddr>,
    pub mode: AveragingMode,
    /// Declared bandwidth, bytes per second.
    pub bandwidth: f64,
}

impl Member {
    /// Parses a member as the wire gives it; a malformed peer id is an error (the group is
    /// refused), never a made-up peer.
    pub fn parse(info: &MemberInfo) -> Result<Self, String> {
        let peer =
            PeerId::from_bytes(&info.peer_id).map_err(|e| format!("invalid peer id: {e}"))?;
        // Every member computes the span split from these: a NaN or negative rate would give
        // every peer a garbage plan.
        if !(info.bandwidth.is_finite() && info.bandwidth > 0.0) {
            return Err(format!("invalid bandwidth {}", info.bandwidth));
        }
        Ok(Member {
            peer,
            addrs: info.addrs.iter().filter_map(|a| a.parse().ok()).collect(),
            mode: info.mode,
            bandwidth: info.bandwidth,
        })
    }
}

/// A formed group.
#[derive(Debug, Clone)]
pub(crate) struct Group {
    pub round_id: u64,
    /// Every member, the leader first (member `i` reduces span `i`; see
    /// `partition::rotated_spans`).
    pub members: Vec<Member>,
    pub my_index: MemberIdx,
}

impl Group {
    pub fn new(round_id: u64, infos: &[MemberInfo], my_index: usize) -> Result<Self, String> {
        let members = infos
            .iter()
            .enumerate()
            .map(|(i, m)| Member::parse(m).map_err(|e| format!("member {i}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Group {
            round_id,
            members,
            my_index: MemberIdx::of(my_index),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(peer_id: Vec<u8>) -> MemberInfo {
        MemberInfo {
            peer_id,
            mode: AveragingMode::Node,
            bandwidth: 1e8,
            addrs: vec!["/ip4/10.0.0.1/tcp/4001".into(), "not an address".into()],
            tag: 0,
        }
    }

    #[test]
    fn members_are_parsed_once_and_malformed_ids_refuse_the_group() {
        let a = PeerId::random();
        let b = PeerId::random();
        let g = Group::new(7, &[info(a.to_bytes()), info(b.to_bytes())], 1).unwrap();
        assert_eq!(g.members[1].peer, b);
        assert_eq!(g.my_index, MemberIdx(1));
        // Addresses that do not parse are left out, not fatal.
        assert_eq!(g.members[0].addrs.len(), 1);
        let err = Group::new(7, &[info(a.to_bytes()), info(vec![1, 2, 3])], 0).unwrap_err();
        assert!(err.contains("member 1"), "{err}");
        for bad in [f64::NAN, f64::INFINITY, -1.0, 0.0] {
            let mut rogue = info(b.to_bytes());
            rogue.bandwidth = bad;
            let err = Group::new(7, &[info(a.to_bytes()), rogue], 0).unwrap_err();
            assert!(err.contains("bandwidth"), "{err}");
        }
    }
}
