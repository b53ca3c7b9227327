use super::*;
use starling_node::{owner_key_of, Keypair};

#[test]
fn a_leader_begins_only_once_every_declared_peer_joined() {
    let (a, b, c) = (vec![1u8], vec![2u8], vec![3u8]);
    let followers = |f: &[Vec<u8>]| f.to_vec();
    let declared = vec![a.clone(), b.clone()];
    let two = followers(&[a.clone(), b.clone()]);
    let one = followers(std::slice::from_ref(&a));
    fn ids(v: &[Vec<u8>]) -> Vec<&[u8]> {
        v.iter().map(Vec::as_slice).collect()
    }
    assert!(everyone_joined(&declared, ids(&two).into_iter(), 2));
    assert!(
        !everyone_joined(&declared, ids(&one).into_iter(), 2),
        "b declared, not joined"
    );
    assert!(
        !everyone_joined(&declared, ids(&two).into_iter(), 4),
        "below min_group_size"
    );
    assert!(
        !everyone_joined(&[], std::iter::empty(), 1),
        "nobody to average with"
    );
    let with_c = vec![a.clone(), b.clone(), c];
    assert!(
        everyone_joined(&declared, ids(&with_c).into_iter(), 2),
        "a follower that joined without a visible declaration"
    );
}

fn declaration(peer: &PeerId) -> Declaration {
    Declaration {
        info: MemberInfo {
            peer_id: peer.to_bytes(),
            mode: AveragingMode::Node,
            bandwidth: 1.0,
            addrs: Vec::new(),
        },
        window_end: 0,
    }
}

#[test]
fn only_declarations_under_the_declared_peers_marker_count() {
    let alice = Keypair::generate_ed25519();
    let mallory = Keypair::generate_ed25519();
    let alice_id = alice.public().to_peer_id();
    let alice_marker = owner_key_of(&alice).unwrap().marker();
    let mallory_marker = owner_key_of(&mallory).unwrap().marker();
    let key = "run.averager.00.0";
    assert!(declared_by_its_peer(
        key,
        &alice_marker,
        &declaration(&alice_id)
    ));
    // Mallory declaring alice (or alice's declaration under a plain sub-key) is ignored.
    assert!(!declared_by_its_peer(
        key,
        &mallory_marker,
        &declaration(&alice_id)
    ));
    assert!(!declared_by_its_peer(
        key,
        &alice_id.to_string(),
        &declaration(&alice_id)
    ));
    assert!(!declared_by_its_peer(
        key,
        "[owner:zz]",
        &declaration(&alice_id)
    ));
    let mut garbled = declaration(&alice_id);
    garbled.info.peer_id = vec![0xff; 3];
    assert!(!declared_by_its_peer(key, &alice_marker, &garbled));
}

fn info(mode: AveragingMode) -> MemberInfo {
    MemberInfo {
        peer_id: PeerId::random().to_bytes(),
        mode,
        bandwidth: 1e8,
        addrs: vec![],
    }
}

#[test]
fn join_requests_are_answered_by_rank_mode_and_state() {
    let me = info(AveragingMode::Node);
    let my_rank = rank(1000, &me.peer_id);
    let later = info(AveragingMode::Node);
    let reply = |who: &MemberInfo, end: u64, asking: Asking, followers: &[&MemberInfo]| {
        join_reply(3, &me, my_rank.clone(), (who, end), asking, followers)
    };
    assert_eq!(reply(&later, 2000, Asking::Nobody, &[]), None);
    // A peer ranked ahead of us read an old declaration; a client may join anyway.
    assert_eq!(
        reply(&later, 500, Asking::Nobody, &[]),
        Some(RejectReason::Stale)
    );
    let client = info(AveragingMode::Client);
    assert_eq!(reply(&client, 500, Asking::Nobody, &[]), None);
    // While asking or following someone else.
    assert_eq!(
        reply(&later, 2000, Asking::Requesting, &[]),
        Some(RejectReason::Busy)
    );
    assert_eq!(
        reply(&later, 2000, Asking::Following, &[]),
        Some(RejectReason::NotLeading)
    );
    // Full, or already in.
    let (a, b) = (info(AveragingMode::Node), info(AveragingMode::Node));
    assert_eq!(
        reply(&later, 2000, Asking::Nobody, &[&a, &b]),
        Some(RejectReason::Full)
    );
    assert_eq!(
        reply(&a, 2000, Asking::Nobody, &[&a]),
        Some(RejectReason::Full)
    );
    // Invalid descriptions, and a client asked to lead.
    let mut nan = info(AveragingMode::Node);
    nan.bandwidth = f64::NAN;
    assert_eq!(
        reply(&nan, 2000, Asking::Nobody, &[]),
        Some(RejectReason::Invalid)
    );
    let me_client = info(AveragingMode::Client);
    let r = join_reply(
        3,
        &me_client,
        rank(1000, &me_client.peer_id),
        (&later, 2000),
        Asking::Nobody,
        &[],
    );
    assert_eq!(r, Some(RejectReason::NotLeading));
}
