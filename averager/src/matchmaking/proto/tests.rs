//! The state machine, event by event, with no network: how join requests are answered, when a
//! leader begins, how a window ends.

use starling_node::PeerId;

use super::*;

fn info(mode: AveragingMode) -> MemberInfo {
    MemberInfo {
        peer_id: PeerId::random().to_bytes(),
        mode,
        bandwidth: 1e8,
        addrs: vec![],
        tag: 0,
    }
}

fn params(target: usize, min: usize) -> Params {
    Params {
        target_group_size: target,
        min_group_size: min,
        start_grace_ms: 100,
        refresh_ms: 200,
        first_refresh_ms: 200,
        busy_backoff_ms: 150,
        swarm: None,
        last_ask_ms: None,
    }
}

fn decl(info: &MemberInfo, window_end: u64) -> Declaration {
    Declaration {
        info: info.clone(),
        window_end,
    }
}

fn reply_to(actions: &[Action], id: JoinId) -> Option<Option<RejectReason>> {
    actions.iter().find_map(|a| match a {
        Action::Reply { id: i, reject } if *i == id => Some(*reject),
        _ => None,
    })
}

/// `search` takes `who` as a follower (request and written acceptance).
fn take(search: &mut Search, now: Ms, id: JoinId, who: &MemberInfo, end: u64) -> Vec<Action> {
    let a = search.handle(
        now,
        Event::Join {
            id,
            info: who.clone(),
            window_end: end,
        },
    );
    assert_eq!(reply_to(&a, id), Some(None), "{who:?} accepted");
    search.handle(now, Event::ReplySent { id, ok: true })
}

#[test]
fn join_requests_are_answered_by_rank_mode_and_state() {
    let me = info(AveragingMode::Node);
    let mut s = Search::new(params(3, 2), me.clone(), 1000, vec![], 0, 5000);
    let join = |s: &mut Search, id, who: &MemberInfo, end| {
        let a = s.handle(
            0,
            Event::Join {
                id,
                info: who.clone(),
                window_end: end,
            },
        );
        reply_to(&a, id).expect("answered")
    };
    // A peer ranked ahead of us read an old declaration; a client may join anyway.
    let later = info(AveragingMode::Node);
    assert_eq!(join(&mut s, 1, &later, 500), Some(RejectReason::Stale));
    let mut nan = info(AveragingMode::Node);
    nan.bandwidth = f64::NAN;
    assert_eq!(join(&mut s, 2, &nan, 2000), Some(RejectReason::Invalid));
    // Accepted; the same peer again, or a third while one acceptance is being written: full.
    take(&mut s, 0, 3, &later, 2000);
    assert_eq!(join(&mut s, 4, &later, 2000), Some(RejectReason::Full));
    let client = info(AveragingMode::Client);
    assert_eq!(join(&mut s, 5, &client, 500), None);
    assert_eq!(
        join(&mut s, 6, &info(AveragingMode::Node), 2000),
        Some(RejectReason::Full)
    );
    // Asking an earlier leader: busy; followed by it: not leading.
    let mut s = Search::new(params(8, 2), me.clone(), 1000, vec![], 0, 5000);
    let leader = info(AveragingMode::Node);
    assert_eq!(s.handle(0, Event::Tick), vec![Action::Read]);
    let a = s.handle(
        10,
        Event::Read(Some(vec![decl(&me, 1000), decl(&leader, 900)])),
    );
    assert_eq!(
        a,
        vec![Action::Ask {
            leader: decl(&leader, 900)
        }]
    );
    assert_eq!(join(&mut s, 7, &later, 2000), Some(RejectReason::Busy));
    s.handle(20, Event::Accepted);
    assert_eq!(
        join(&mut s, 8, &later, 2000),
        Some(RejectReason::NotLeading)
    );
    let a = s.handle(
        30,
        Event::Asked {
            leader: leader.peer_id.clone(),
            outcome: Asked::Grouped,
        },
    );
    assert_eq!(a, vec![Action::Finish(Outcome::Followed)]);
    assert_eq!(
        join(&mut s, 9, &later, 2000),
        Some(RejectReason::NotSearching)
    );
    // A client never leads.
    let me_client = info(AveragingMode::Client);
    let mut s = Search::new(params(3, 2), me_client, 1000, vec![], 0, 5000);
    assert_eq!(
        join(&mut s, 1, &later, 2000),
        Some(RejectReason::NotLeading)
    );
}

/// The earliest peer was following a leader when we asked it; that leader died, and it searches
/// again. Giving up on it for the window split the survivors: it could not ask us (we rank
/// behind it), we would not ask it, and each began with whoever else it had at window end.
#[test]
fn a_peer_that_was_following_is_asked_again_after_a_pause() {
    let me = info(AveragingMode::Node);
    let earliest = info(AveragingMode::Node);
    let mut s = Search::new(params(4, 2), me.clone(), 1000, vec![], 0, 5000);
    assert_eq!(s.handle(0, Event::Tick), vec![Action::Read]);
    let entries = vec![decl(&me, 1000), decl(&earliest, 900)];
    let a = s.handle(10, Event::Read(Some(entries.clone())));
    assert_eq!(
        a,
        vec![Action::Ask {
            leader: decl(&earliest, 900)
        }]
    );
    let a = s.handle(
        20,
        Event::Asked {
            leader: earliest.peer_id.clone(),
            outcome: on_reject(RejectReason::NotLeading),
        },
    );
    // Backed off: the last read offers nobody else, so it reads again...
    assert!(!a.iter().any(|x| matches!(x, Action::Ask { .. })), "{a:?}");
    let mut t = 20;
    let mut asked = false;
    while t < 1000 && !asked {
        t += 50;
        for action in s.handle(t, Event::Tick) {
            if action == Action::Read {
                let a = s.handle(t, Event::Read(Some(entries.clone())));
                asked = a.contains(&Action::Ask {
                    leader: decl(&earliest, 900),
                });
            }
        }
    }
    // ...and asks the earliest peer again once the pause is over.
    assert!(asked, "never asked again");
    assert!(
        t >= 20 + 150,
        "asked again at {t} ms, before the pause ended"
    );
}

#[test]
fn a_leader_begins_once_every_declared_peer_joined_after_the_grace() {
    let me = info(AveragingMode::Node);
    let (a, b) = (info(AveragingMode::Node), info(AveragingMode::Node));
    let everyone = vec![decl(&me, 1000), decl(&a, 2000), decl(&b, 2000)];
    let mut s = Search::new(params(8, 2), me.clone(), 1000, vec![], 0, 5000);
    assert_eq!(s.handle(0, Event::Tick), vec![Action::Read]);
    assert!(s.handle(5, Event::Read(Some(everyone.clone()))).is_empty());
    take(&mut s, 10, 1, &a, 2000);
    // b declared and has not joined: after the grace, begin without it only if it is gone.
    assert_eq!(s.handle(200, Event::Tick), vec![Action::Read]);
    assert_eq!(
        s.handle(205, Event::Read(Some(everyone.clone()))),
        vec![Action::CheckGone {
            connected: vec![],
            reachable: vec![b.clone()]
        }]
    );
    assert!(s.handle(206, Event::Gone(false)).is_empty());
    take(&mut s, 210, 2, &b, 2000);
    // Everyone joined: the next read (due at once) begins.
    assert_eq!(s.next_wakeup(), Some(210));
    assert_eq!(s.handle(210, Event::Tick), vec![Action::Read]);
    let began = s.handle(215, Event::Read(Some(everyone)));
    assert_eq!(
        began,
        vec![
            Action::Begin {
                followers: vec![1, 2],
                members: vec![me, a, b]
            },
            Action::Finish(Outcome::Led)
        ]
    );
    assert_eq!(s.next_wakeup(), None);
}

#[test]
fn after_the_grace_a_leader_begins_without_a_declared_peer_that_is_gone() {
    let me = info(AveragingMode::Node);
    let (a, dead) = (info(AveragingMode::Node), info(AveragingMode::Node));
    let declared = vec![decl(&me, 1000), decl(&a, 2000), decl(&dead, 2000)];
    let mut s = Search::new(params(8, 2), me.clone(), 1000, vec![], 0, 5000);
    take(&mut s, 1, 1, &a, 2000);
    s.handle(1, Event::Tick);
    // Within the grace: nothing (it may be late, not dead).
    assert!(s.handle(5, Event::Read(Some(declared.clone()))).is_empty());
    s.handle(201, Event::Tick);
    assert_eq!(
        s.handle(202, Event::Read(Some(declared))),
        vec![Action::CheckGone {
            connected: vec![],
            reachable: vec![dead.clone()]
        }]
    );
    let began = s.handle(203, Event::Gone(true));
    assert_eq!(
        began,
        vec![
            Action::Begin {
                followers: vec![1],
                members: vec![me, a]
            },
            Action::Finish(Outcome::Led)
        ]
    );
}

#[test]
fn within_the_grace_a_leader_begins_when_its_previous_group_is_here_or_gone() {
    let me = info(AveragingMode::Node);
    let (a, x) = (info(AveragingMode::Node), info(AveragingMode::Node));
    let declared = vec![decl(&me, 1000), decl(&a, 2000)];
    // The whole previous group joined: at once.
    let mut s = Search::new(
        params(8, 2),
        me.clone(),
        1000,
        vec![a.peer_id.clone()],
        0,
        5000,
    );
    take(&mut s, 1, 1, &a, 2000);
    assert_eq!(s.handle(1, Event::Tick), vec![Action::Read]);
    let began = s.handle(5, Event::Read(Some(declared.clone())));
    assert!(matches!(began.last(), Some(Action::Finish(Outcome::Led))));
    // x of the previous group is missing: begin only if it is gone.
    for gone in [true, false] {
        let previous = vec![a.peer_id.clone(), x.peer_id.clone()];
        let mut s = Search::new(params(8, 2), me.clone(), 1000, previous, 0, 5000);
        take(&mut s, 1, 1, &a, 2000);
        s.handle(1, Event::Tick);
        let asked = s.handle(5, Event::Read(Some(declared.clone())));
        assert_eq!(
            asked,
            vec![Action::CheckGone {
                connected: vec![x.peer_id.clone()],
                reachable: vec![]
            }]
        );
        let then = s.handle(6, Event::Gone(gone));
        assert_eq!(
            matches!(then.last(), Some(Action::Finish(Outcome::Led))),
            gone
        );
    }
    // A previous group smaller than the swarm expected (a pair of four peers) waits for the
    // grace: re-forming it at once kept the swarm split in the same pairs every round (the
    // PowerSGD netns bench of #28: groups of 2, 2, 2, 2 at every step).
    let mut p = params(8, 2);
    p.swarm = Some(4);
    let mut s = Search::new(
        p.clone(),
        me.clone(),
        1000,
        vec![a.peer_id.clone()],
        0,
        5000,
    );
    take(&mut s, 1, 1, &a, 2000);
    s.handle(1, Event::Tick);
    assert!(s.handle(5, Event::Read(Some(declared.clone()))).is_empty());
    assert_eq!(s.handle(205, Event::Tick), vec![Action::Read]);
    let began = s.handle(206, Event::Read(Some(declared.clone())));
    assert!(matches!(began.last(), Some(Action::Finish(Outcome::Led))));
    // ... while a previous group of the whole swarm still begins at once.
    p.swarm = Some(2);
    let mut s = Search::new(p, me.clone(), 1000, vec![a.peer_id.clone()], 0, 5000);
    take(&mut s, 1, 1, &a, 2000);
    s.handle(1, Event::Tick);
    let began = s.handle(5, Event::Read(Some(declared.clone())));
    assert!(matches!(began.last(), Some(Action::Finish(Outcome::Led))));
    // No previous group: wait for the grace.
    let mut s = Search::new(params(8, 2), me.clone(), 1000, vec![], 0, 5000);
    take(&mut s, 1, 1, &a, 2000);
    s.handle(1, Event::Tick);
    assert!(s.handle(5, Event::Read(Some(declared.clone()))).is_empty());
    assert_eq!(s.handle(205, Event::Tick), vec![Action::Read]);
    let began = s.handle(206, Event::Read(Some(declared)));
    assert!(matches!(began.last(), Some(Action::Finish(Outcome::Led))));
}

#[test]
fn a_window_ends_with_a_group_of_enough_followers_or_again_or_alone() {
    let me = info(AveragingMode::Node);
    let a = info(AveragingMode::Node);
    // Followers below the minimum are disbanded; others were seen: again.
    let mut s = Search::new(params(8, 3), me.clone(), 1000, vec![], 0, 5000);
    s.handle(0, Event::Tick);
    take(&mut s, 1, 1, &a, 2000);
    assert_eq!(
        s.handle(5000, Event::Tick),
        vec![
            Action::Disband { followers: vec![1] },
            Action::Finish(Outcome::Again)
        ]
    );
    // Enough followers: begin at the end.
    let mut s = Search::new(params(8, 2), me.clone(), 1000, vec![], 0, 5000);
    s.handle(0, Event::Tick);
    take(&mut s, 1, 1, &a, 2000);
    let end = s.handle(5000, Event::Tick);
    assert!(matches!(end.last(), Some(Action::Finish(Outcome::Led))));
    // Nobody at all: alone.
    let mut s = Search::new(params(8, 2), me.clone(), 1000, vec![], 0, 5000);
    s.handle(0, Event::Tick);
    s.handle(5, Event::Read(Some(vec![decl(&me, 1000)])));
    assert_eq!(
        s.handle(5000, Event::Tick),
        vec![Action::Finish(Outcome::Alone)]
    );
}

#[test]
fn a_refused_leader_is_not_asked_again_and_a_busy_one_after_a_pause() {
    let me = info(AveragingMode::Node);
    let (l1, l2) = (info(AveragingMode::Node), info(AveragingMode::Node));
    let read = vec![decl(&me, 1000), decl(&l1, 800), decl(&l2, 900)];
    let mut s = Search::new(params(8, 2), me.clone(), 1000, vec![], 0, 5000);
    s.handle(0, Event::Tick);
    let a = s.handle(1, Event::Read(Some(read.clone())));
    assert_eq!(
        a,
        vec![Action::Ask {
            leader: decl(&l1, 800)
        }]
    );
    // l1 busy: the next one of the fresh read at once.
    let a = s.handle(
        10,
        Event::Asked {
            leader: l1.peer_id.clone(),
            outcome: Asked::Busy,
        },
    );
    assert_eq!(
        a,
        vec![Action::Ask {
            leader: decl(&l2, 900)
        }]
    );
    // l2 refuses: nobody left in the read; read again now.
    let a = s.handle(
        20,
        Event::Asked {
            leader: l2.peer_id.clone(),
            outcome: Asked::Refused("gone".into()),
        },
    );
    assert!(a.is_empty());
    assert_eq!(s.next_wakeup(), Some(20));
    s.handle(20, Event::Tick);
    // Within l1's pause only l2 would do, and it refused.
    assert!(s.handle(100, Event::Read(Some(read.clone()))).is_empty());
    s.handle(300, Event::Tick);
    let a = s.handle(300, Event::Read(Some(read)));
    assert_eq!(
        a,
        vec![Action::Ask {
            leader: decl(&l1, 800)
        }]
    );
}

#[test]
fn peers_in_other_rounds_never_group_and_the_one_behind_learns_it_at_once() {
    let tagged = |tag| MemberInfo {
        tag,
        ..info(AveragingMode::Node)
    };
    let me = tagged(7);
    // A join from another round is refused; one from a later round also ends this search
    // (with its follower let go), long before the window ends.
    let mut s = Search::new(params(8, 2), me.clone(), 1000, vec![], 0, 5000);
    s.handle(0, Event::Tick);
    let same = tagged(7);
    take(&mut s, 1, 1, &same, 2000);
    let ask = |s: &mut Search, id: JoinId, info: MemberInfo| {
        let a = s.handle(
            id,
            Event::Join {
                id,
                info,
                window_end: 2000,
            },
        );
        assert_eq!(reply_to(&a, id), Some(Some(RejectReason::OtherRound)));
        a
    };
    let a = ask(&mut s, 2, tagged(6));
    assert!(!a.iter().any(|a| matches!(a, Action::Finish(_))), "{a:?}");
    let a = ask(&mut s, 3, tagged(8));
    assert_eq!(
        a[1..],
        [
            Action::Disband { followers: vec![1] },
            Action::Finish(Outcome::Behind(8))
        ]
    );
    // A read that shows a later round's declaration ends the search too.
    let mut s = Search::new(params(8, 2), me.clone(), 1000, vec![], 0, 5000);
    s.handle(0, Event::Tick);
    let a = s.handle(
        5,
        Event::Read(Some(vec![decl(&me, 1000), decl(&tagged(9), 500)])),
    );
    assert_eq!(a, vec![Action::Finish(Outcome::Behind(9))]);
    // An earlier round's peer is never followed, whatever its rank; the window ends alone.
    let mut s = Search::new(params(8, 2), me.clone(), 1000, vec![], 0, 5000);
    s.handle(0, Event::Tick);
    let a = s.handle(
        5,
        Event::Read(Some(vec![decl(&me, 1000), decl(&tagged(6), 500)])),
    );
    assert!(!a.iter().any(|a| matches!(a, Action::Ask { .. })), "{a:?}");
    assert_eq!(
        s.handle(5000, Event::Tick),
        vec![Action::Finish(Outcome::Again)]
    );
    // The same round's peer ranked ahead is asked, as always.
    let mut s = Search::new(params(8, 2), me.clone(), 1000, vec![], 0, 5000);
    s.handle(0, Event::Tick);
    let a = s.handle(
        5,
        Event::Read(Some(vec![decl(&me, 1000), decl(&tagged(7), 500)])),
    );
    assert!(a.iter().any(|a| matches!(a, Action::Ask { .. })), "{a:?}");
}

#[test]
fn reads_come_soon_at_first_then_every_refresh() {
    // Alone under the key for the whole window: reads at 0, then after 25, 50, 100 and then
    // every 200 ms (each wait counted from the start of the read before).
    let me = info(AveragingMode::Node);
    let p = Params {
        first_refresh_ms: 25,
        ..params(4, 2)
    };
    let mut s = Search::new(p, me.clone(), 1000, vec![], 0, 5000);
    let mut reads = Vec::new();
    let mut now = 0;
    while reads.len() < 7 {
        now = s.next_wakeup().expect("searching");
        assert_eq!(s.handle(now, Event::Tick), vec![Action::Read], "at {now}");
        reads.push(now);
        assert!(s
            .handle(now + 2, Event::Read(Some(vec![decl(&me, 1000)])))
            .is_empty());
    }
    assert_eq!(reads, [0, 25, 75, 175, 375, 575, 775], "ended at {now}");
}

/// Three `Node` members whose peer ids sort as listed (the first leads a re-formed group).
fn sorted_trio() -> (MemberInfo, MemberInfo, MemberInfo) {
    let mut v: Vec<MemberInfo> = (0..3).map(|_| info(AveragingMode::Node)).collect();
    v.sort_by(|a, b| a.peer_id.cmp(&b.peer_id));
    let c = v.pop().expect("three");
    let b = v.pop().expect("three");
    let a = v.pop().expect("three");
    (a, b, c)
}

fn whole_swarm(n: usize) -> Params {
    let mut p = params(8, 2);
    p.swarm = Some(n);
    p.first_refresh_ms = 25;
    p.start_grace_ms = 400;
    p
}

#[test]
fn a_member_of_a_group_that_held_the_swarm_asks_its_leader_directly_and_falls_back() {
    let (lead, me, other) = sorted_trio();
    let previous = vec![lead.peer_id.clone(), other.peer_id.clone()];
    // Its last join request was answered in 3 ms, within a tenth of the 400 ms grace.
    let quick = Params {
        last_ask_ms: Some(3),
        ..whole_swarm(3)
    };
    let sticky =
        || Search::new(quick.clone(), me.clone(), 1000, previous.clone(), 0, 5000).sticky();
    let l = lead.peer_id.clone();
    let asked = |outcome| Event::Asked {
        leader: l.clone(),
        outcome,
    };
    let mut s = sticky();
    // Nobody reads its declaration: it declares only if it falls back.
    assert!(!s.declares_at_open());
    // Unless its join requests are slow, or not measured yet: then it declares at once (a
    // leader whose grace ends before a member's request arrives must know the member comes),
    // and does not again when it falls back.
    for last_ask_ms in [None, Some(41)] {
        let p = Params {
            last_ask_ms,
            ..whole_swarm(3)
        };
        let mut slow = Search::new(p, me.clone(), 1000, previous.clone(), 0, 5000).sticky();
        assert!(slow.declares_at_open(), "{last_ask_ms:?}");
        assert!(matches!(
            &slow.handle(0, Event::Tick)[..],
            [Action::Ask { .. }]
        ));
        assert!(slow.handle(4, asked(Asked::Busy)).is_empty());
        assert_eq!(slow.handle(4, Event::Tick), vec![Action::Read]);
    }
    // No read: the leader is asked at once, as a made-up declaration of this round.
    let first = s.handle(0, Event::Tick);
    let [Action::Ask { leader }] = &first[..] else {
        panic!("{first:?}");
    };
    assert_eq!(
        (&leader.info.peer_id, leader.info.tag),
        (&lead.peer_id, me.tag)
    );
    assert!(Member::parse(&leader.info).is_ok());
    // Not searching yet: again shortly, still without a read.
    assert!(s.handle(3, asked(Asked::NotSearching)).is_empty());
    assert_eq!(s.next_wakeup(), Some(3 + STICKY_RETRY_MS));
    let again = s.handle(3 + STICKY_RETRY_MS, Event::Tick);
    assert!(matches!(&again[..], [Action::Ask { .. }]), "{again:?}");
    // Taken: a group.
    s.handle(9, Event::Accepted);
    let done = s.handle(9, asked(Asked::Grouped));
    assert_eq!(done, vec![Action::Finish(Outcome::Followed)]);

    // A leader that is not searching by half the grace: read, the usual way (and the leader
    // is not refused for the window).
    let mut s = sticky();
    s.handle(0, Event::Tick);
    let mut now = 0;
    let fell_back_at = loop {
        now += 1;
        let mut out = s.handle(now, asked(Asked::NotSearching));
        now = s.next_wakeup().expect("something is due");
        out.extend(s.handle(now, Event::Tick));
        if out.contains(&Action::Read) {
            // It declares itself as it falls back, before its first read.
            assert_eq!(out, vec![Action::Declare, Action::Read]);
            break now;
        }
        assert!(
            matches!(&out[..], [Action::Ask { .. }]) && now < 1000,
            "{out:?}"
        );
    };
    assert!(
        (195..=205).contains(&fell_back_at),
        "fell back at {fell_back_at}"
    );
    let read = s.handle(
        fell_back_at + 1,
        Event::Read(Some(vec![decl(&lead, 900), decl(&me, 1000)])),
    );
    assert!(
        matches!(&read[..], [Action::Ask { leader }] if leader.info.peer_id == lead.peer_id),
        "{read:?}"
    );

    // No answer (the request's stream failed): again shortly, as for a leader not searching.
    let mut s = sticky();
    s.handle(0, Event::Tick);
    assert!(s.handle(4, asked(Asked::Dropped)).is_empty());
    assert_eq!(s.next_wakeup(), Some(4 + STICKY_RETRY_MS));
    let again = s.handle(4 + STICKY_RETRY_MS, Event::Tick);
    assert!(matches!(&again[..], [Action::Ask { .. }]), "{again:?}");

    // A leader busy with another group, or refusing (another round, full): the usual way at
    // once.
    for outcome in [Asked::Busy, Asked::Refused("Full".into())] {
        let mut s = sticky();
        s.handle(0, Event::Tick);
        assert_eq!(s.handle(4, asked(outcome)), vec![Action::Declare]);
        assert_eq!(s.handle(4, Event::Tick), vec![Action::Read]);
    }

    // Not when the previous group was not the whole swarm, nor for a client: a read first.
    for (n, mode) in [(4, AveragingMode::Node), (3, AveragingMode::Client)] {
        let who = MemberInfo { mode, ..me.clone() };
        let mut s = Search::new(whole_swarm(n), who, 1000, previous.clone(), 0, 5000).sticky();
        assert!(s.declares_at_open());
        assert_eq!(s.handle(0, Event::Tick), vec![Action::Read]);
    }
}

#[test]
fn the_leader_of_a_group_that_held_the_swarm_takes_its_members_whatever_their_rank() {
    let (me, a, b) = sorted_trio();
    let previous = vec![a.peer_id.clone(), b.peer_id.clone()];
    let mut s = Search::new(whole_swarm(3), me.clone(), 5000, previous, 0, 5000).sticky();
    // It declares (a newcomer must see it).
    assert!(s.declares_at_open());
    // Its first read waits a little for its members.
    assert!(s.handle(0, Event::Tick).is_empty());
    assert_eq!(s.next_wakeup(), Some(25));
    // Members that declared earlier windows (ranked ahead) are taken all the same, and the
    // group begins as the last one joins, without a read.
    take(&mut s, 2, 1, &a, 1000);
    let began = take(&mut s, 3, 2, &b, 1000);
    match &began[..] {
        [Action::Begin { members, .. }, Action::Finish(Outcome::Led)] => {
            assert_eq!(members.len(), 3)
        }
        other => panic!("{other:?}"),
    }
    // A newcomer ranked ahead is still refused as stale (it read an old declaration).
    let (me, a, b) = sorted_trio();
    let mut s = Search::new(
        whole_swarm(3),
        me.clone(),
        5000,
        vec![a.peer_id.clone(), b.peer_id.clone()],
        0,
        5000,
    )
    .sticky();
    s.handle(0, Event::Tick);
    let stranger = info(AveragingMode::Node);
    let out = s.handle(
        1,
        Event::Join {
            id: 7,
            info: stranger,
            window_end: 1000,
        },
    );
    assert_eq!(reply_to(&out, 7), Some(Some(RejectReason::Stale)));
    // A member missing after the first read: the usual way (it waits for it, or the grace).
    take(&mut s, 2, 1, &a, 1000);
    assert_eq!(s.handle(25, Event::Tick), vec![Action::Read]);
}
