use super::*;
use crate::config::AveragingMode;
use starling_node::{owner_key_of, Keypair};

fn declaration(peer: &PeerId) -> Declaration {
    Declaration {
        info: MemberInfo {
            peer_id: peer.to_bytes(),
            mode: AveragingMode::Node,
            bandwidth: 1.0,
            addrs: Vec::new(),
            tag: 0,
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

#[test]
fn only_a_tagged_group_of_everyone_expected_leaves_its_declaration_open() {
    let infos: Vec<MemberInfo> = (0..3)
        .map(|_| declaration(&Keypair::generate_ed25519().public().to_peer_id()).info)
        .collect();
    let trio = Group::new(7, &infos, 0).unwrap();
    let pair = Group::new(7, &infos[..2], 0).unwrap();
    assert!(holds_everyone(&trio, 5, Some(3)));
    assert!(holds_everyone(&trio, 5, Some(2)));
    // A peer expected to search is not in the group: it may still read the key.
    assert!(!holds_everyone(&pair, 5, Some(3)));
    // No hint, or untagged rounds (the next search reads the key under the same tag).
    assert!(!holds_everyone(&trio, 5, None));
    assert!(!holds_everyone(&trio, 0, Some(3)));
    // A hint of one peer says nothing about others searching.
    let alone = Group::new(7, &infos[..1], 0).unwrap();
    assert!(!holds_everyone(&alone, 5, Some(1)));
}
