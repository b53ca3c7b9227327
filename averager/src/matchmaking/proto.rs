//! Matchmaking's states as a pure state machine: [`Search::handle`] takes an [`Event`] and
//! returns [`Action`]s, with no I/O and no clock of its own (every event carries the time, in
//! milliseconds of a monotonic clock the driver chooses). The async shell in the parent module
//! drives it over the DHT and streams; the simulator in `sim.rs` drives many of them in virtual
//! time. (iroh-gossip's `proto`/`net` split.)
//!
//! One [`Search`] is one search window of one peer. Its [`Phase`]:
//!
//! - **Searching**: declared under the group key; reads the key every
//!   [`Params::refresh_ms`] (sooner at first: [`Params::first_refresh_ms`]) and asks the
//!   earliest-ranked leader ahead of it; accepts join requests from peers ranked behind it (it
//!   *leads* them until it begins or disbands them);
//! - **Requesting** a leader: a join request is in flight; other join requests get `Busy`;
//! - **Following** a leader that accepted: other join requests get `NotLeading`; the leader's
//!   `Begin` (a group) or `Disband` (search again) ends it;
//! - **Done**: the window ended ([`Outcome`]).
//!
//! A leader begins when its group is full; when every peer declared under the key has joined
//! (after [`Params::start_grace_ms`], or at once when every member of its previous group is
//! here or gone and that group held every peer expected, [`Params::swarm`]); after the grace, when the declared peers that have not joined are all gone
//! (cannot be reached: a peer that died leaves its declaration behind until its window ends); or
//! when its window ends with at least [`Params::min_group_size`].
//!
//! **A group that held the whole swarm re-forms without reading the key** ([`Search::sticky`]):
//! when this peer's previous group held every peer the caller expects ([`Params::swarm`]), its
//! members agree without a word on the smallest peer id among them as the leader. The leader
//! still declares (a newcomer must see who searches); its members declare only if they fall
//! back to the usual search, or where their last join request was slow
//! ([`Search::declares_at_open`]). The leader reads the key only after
//! [`Params::first_refresh_ms`], accepts its previous members whatever their rank, does not go
//! to them while they may still come (until half the start grace), and begins the moment all of
//! them joined. The others do not read: they ask it directly ([`Action::Ask`] with a
//! declaration made up from the previous group), again every [`STICKY_RETRY_MS`] while it is
//! not searching yet, and search the usual way when it answers otherwise (busy with another
//! group, full, another round) or has not taken them within half the start grace (the other
//! half is for them to find each other the usual way). A stable pair's step cost its two peers
//! six DHT operations on the key (two declarations, reads and closes); now one (the leader's
//! declaration: a tagged group of everyone leaves it open). In the simulator's stable four-peer
//! swarms (61 seeds) it reads the key a third less often, with as many peers grouped.

use std::collections::{HashMap, HashSet};

use crate::config::AveragingMode;
use crate::group::Member;
use crate::wire::{Declaration, MemberInfo, RejectReason};

/// Milliseconds of the driver's monotonic clock.
pub(crate) type Ms = u64;

/// A join request, as the driver numbered it.
pub(crate) type JoinId = u64;

/// How soon a member of a re-forming group asks its leader again after the leader answered
/// that it is not searching yet (its step is still computing).
pub(crate) const STICKY_RETRY_MS: Ms = 5;

/// A member of a re-forming group leaves its declaration out only if its last join request was
/// answered within this share of the start grace (see [`Search::declares_at_open`]).
pub(crate) const QUICK_ASK_SHARE: Ms = 10;

/// The settings a search runs with.
#[derive(Debug, Clone)]
pub(crate) struct Params {
    /// Members a group stops growing at.
    pub target_group_size: usize,
    /// Fewest members a group may begin with.
    pub min_group_size: usize,
    /// How long a leader waits before beginning with every declared peer but fewer than the
    /// target (`AveragerConfig::effective_start_grace`).
    pub start_grace_ms: Ms,
    /// How often the group key is read, once the window's first reads found no group.
    pub refresh_ms: Ms,
    /// The wait before the window's second read; each later wait doubles, up to `refresh_ms`.
    /// A peer that declared just after this one's first read is seen within this much, not a
    /// whole `refresh_ms` later (a joiner whose first read missed the others' declarations
    /// held itself and them up by a full refresh).
    pub first_refresh_ms: Ms,
    /// How long a leader that answered `Busy` (or disbanded) is left alone.
    pub busy_backoff_ms: Ms,
    /// The peers the caller expects to search (`Averager::expect_peers`), if it said: a
    /// previous group smaller than that is not "everyone", and re-forming it at once would
    /// keep the swarm split in the same parts round after round.
    pub swarm: Option<usize>,
    /// How long this peer's last join request took to be answered (the driver's clock, from
    /// asking to the leader's answer), if it made one: whether a member of a re-forming group
    /// may leave its declaration out ([`Search::declares_at_open`]).
    pub last_ask_ms: Option<Ms>,
}

/// Where this peer stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Declared, reading the key, perhaps leading followers.
    Searching,
    /// Asking `leader` to take us.
    Requesting {
        /// The leader's peer id.
        leader: Vec<u8>,
    },
    /// `leader` took us; waiting for its decision.
    Following {
        /// The leader's peer id.
        leader: Vec<u8>,
    },
    /// The window ended.
    Done,
}

/// How a request to a leader ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Asked {
    /// The leader began a group with us (the driver holds it).
    Grouped,
    /// The leader disbanded its followers: ask again after a pause.
    Disbanded,
    /// The leader was busy (or ranked us by an old declaration): ask again after a pause.
    Busy,
    /// No answer came: the request's stream failed before one (dropped by the leader's accept
    /// queue under a burst of requests, or its connection closed). Like [`Asked::Busy`], except
    /// that a member of a re-forming group asks its leader again shortly instead of falling
    /// back (see [`Search::sticky`]): the leader said nothing of being busy with another group.
    Dropped,
    /// The leader is not searching under the key (yet, or any more): not again in this
    /// window, except by a member of a re-forming group ([`Search::sticky`]).
    NotSearching,
    /// The leader refused or failed: not again in this window.
    Refused(String),
}

/// What happened.
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// Time passed: the driver calls this at [`Search::next_wakeup`] (or whenever it likes).
    Tick,
    /// A join request arrived (the driver answers it as [`Action::Reply`] says, then reports
    /// [`Event::ReplySent`] for an acceptance).
    Join {
        /// The driver's number for it.
        id: JoinId,
        /// The joiner.
        info: MemberInfo,
        /// The joiner's window end (unix ms).
        window_end: u64,
    },
    /// The acceptance of join request `id` reached the joiner (`ok`) or did not.
    ReplySent {
        /// Which request.
        id: JoinId,
        /// Whether the reply was written.
        ok: bool,
    },
    /// The leader asked accepted us: we follow it now.
    Accepted,
    /// The request to `leader` ended.
    Asked {
        /// The leader's peer id.
        leader: Vec<u8>,
        /// How.
        outcome: Asked,
    },
    /// A read of the group key ended: the live declarations, or `None` if it failed.
    Read(Option<Vec<Declaration>>),
    /// The answer to [`Action::CheckGone`]: whether all those peers are gone.
    Gone(bool),
}

/// What the driver must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    /// Answer join request `id`: accept (`None`) or reject.
    Reply {
        /// Which request.
        id: JoinId,
        /// `None` accepts.
        reject: Option<RejectReason>,
    },
    /// Ask `leader` to take us (report [`Event::Accepted`] and [`Event::Asked`]).
    Ask {
        /// The leader's declaration.
        leader: Declaration,
    },
    /// Declare this peer under the group key: a member of a re-forming group that falls back
    /// to the usual search (it did not declare when its window opened, see
    /// [`Search::declares_at_open`]).
    Declare,
    /// Read the group key (report [`Event::Read`]).
    Read,
    /// Report whether all these peers are gone ([`Event::Gone`]): none of `connected` has a
    /// connection open, and none of `reachable` has one or can be dialed.
    CheckGone {
        /// Members of the previous group that have not joined: gone when not connected (the
        /// connection this peer had to them closed).
        connected: Vec<Vec<u8>>,
        /// Declared peers that have not joined: gone when they cannot be reached either (one
        /// this peer never talked to may simply not have dialed yet).
        reachable: Vec<MemberInfo>,
    },
    /// Tell these followers to search again and let them go.
    Disband {
        /// The accepted join requests.
        followers: Vec<JoinId>,
    },
    /// Begin a group led by this peer: tell these followers the member list (this peer
    /// first, then the followers in this order).
    Begin {
        /// The accepted join requests, in member order.
        followers: Vec<JoinId>,
        /// Every member, this peer first.
        members: Vec<MemberInfo>,
    },
    /// The window ended.
    Finish(Outcome),
}

/// How a window ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// In a group this peer leads ([`Action::Begin`] came just before).
    Led,
    /// In the group of the leader it followed.
    Followed,
    /// Others searched too but no group formed: search again.
    Again,
    /// No other peer searched under the key during the whole window.
    Alone,
    /// Another peer searched under the key with this greater round tag: this peer is behind.
    Behind(u64),
}

/// What a leader's rejection means to the peer that asked: ask again after a pause
/// ([`Asked::Busy`]) when the leader was busy with its own request, ranked us by an old
/// declaration, or follows another leader (which may disband or die: its followers search
/// again, and a peer that gave up on the earliest of them for the window could never join it,
/// requests going only to earlier peers); otherwise not again in this window (full, not
/// searching, another round, invalid). Clients, which never lead, are never asked.
pub(crate) fn on_reject(reason: RejectReason) -> Asked {
    match reason {
        RejectReason::Busy | RejectReason::Stale | RejectReason::NotLeading => Asked::Busy,
        RejectReason::NotSearching => Asked::NotSearching,
        other => Asked::Refused(format!("{other:?}")),
    }
}

/// A peer's rank: the earliest window end leads; ties go to the smaller peer id.
pub(crate) fn rank(window_end: u64, peer: &[u8]) -> (u64, Vec<u8>) {
    (window_end, peer.to_vec())
}

/// One search window of one peer. See the [module docs](self).
#[derive(Debug)]
pub(crate) struct Search {
    params: Params,
    me: MemberInfo,
    my_rank: (u64, Vec<u8>),
    /// When the window opened and ends (driver's clock).
    opened: Ms,
    window_end: Ms,
    phase: Phase,
    /// Accepted followers, in the order they joined.
    followers: Vec<(JoinId, MemberInfo)>,
    /// Join requests accepted whose acceptance is being written.
    accepting: HashMap<JoinId, MemberInfo>,
    refused: HashSet<Vec<u8>>,
    busy: HashMap<Vec<u8>, Ms>,
    /// The last read of the key and when it was taken: a refused or busy leader's successor is
    /// taken from it while fresh rather than from a new lookup (a join request is one stream;
    /// a lookup asks a score of peers).
    last_read: Option<(Ms, Vec<Declaration>)>,
    /// Whether another peer searches under the key: as of the last read, or asked to join since.
    saw_others: bool,
    /// When the key is read next (while searching and not full).
    next_read: Ms,
    /// The wait after the next read (see [`Params::first_refresh_ms`]).
    refresh_wait: Ms,
    /// A read is in flight, started then.
    reading: Option<Ms>,
    /// A [`Action::CheckGone`] is in flight.
    checking: bool,
    /// The other members of this peer's previous group (empty before its first).
    previous: Vec<Vec<u8>>,
    /// The previous group re-forms around this leader ([`Search::sticky`]): its peer id.
    sticky: Option<Vec<u8>>,
    /// A member of the re-forming group (not its leader) searches the usual way now.
    fell_back: bool,
    /// A member of a re-forming group asks its leader again at this time.
    sticky_retry: Option<Ms>,
}

impl Search {
    /// A window opening at `now` and lasting until `window_end` (driver's clock), in which this
    /// peer declared `me` with rank `my_rank` (its declared window end in unix ms).
    pub fn new(
        params: Params,
        me: MemberInfo,
        declared_window_end: u64,
        previous: Vec<Vec<u8>>,
        now: Ms,
        window_end: Ms,
    ) -> Self {
        let my_rank = rank(declared_window_end, &me.peer_id);
        Search {
            me,
            my_rank,
            opened: now,
            window_end,
            phase: Phase::Searching,
            followers: Vec::new(),
            accepting: HashMap::new(),
            refused: HashSet::new(),
            busy: HashMap::new(),
            last_read: None,
            saw_others: false,
            next_read: now,
            refresh_wait: params.first_refresh_ms.clamp(1, params.refresh_ms.max(1)),
            reading: None,
            checking: false,
            previous,
            params,
            sticky: None,
            fell_back: false,
            sticky_retry: None,
        }
    }

    /// Where this peer stands.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// How many followers it leads.
    pub fn followers(&self) -> usize {
        self.followers.len()
    }

    /// When the driver should report [`Event::Tick`] next, if nothing else happens first
    /// (`None`: nothing is due until another event).
    pub fn next_wakeup(&self) -> Option<Ms> {
        if self.phase != Phase::Searching {
            return None;
        }
        let read = (self.reading.is_none() && !self.full()).then_some(self.next_read);
        let at = read.map_or(self.window_end, |r| r.min(self.window_end));
        Some(self.sticky_retry.map_or(at, |r| r.min(at)))
    }

    fn full(&self) -> bool {
        self.followers.len() + 1 >= self.params.target_group_size
    }

    /// Handles one event at `now`; the actions to take, in order.
    pub fn handle(&mut self, now: Ms, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        if self.phase == Phase::Done {
            // Late answers after the end: refuse joins, ignore the rest.
            if let Event::Join { id, .. } = event {
                out.push(Action::Reply {
                    id,
                    reject: Some(RejectReason::NotSearching),
                });
            }
            return out;
        }
        match event {
            Event::Tick => self.tick(now, &mut out),
            Event::Join {
                id,
                info,
                window_end,
            } => self.join(id, info, window_end, &mut out),
            Event::ReplySent { id, ok } => self.reply_sent(now, id, ok, &mut out),
            Event::Accepted => {
                if let Phase::Requesting { leader } = &self.phase {
                    self.phase = Phase::Following {
                        leader: leader.clone(),
                    };
                }
            }
            Event::Asked { leader, outcome } => self.asked(now, leader, outcome, &mut out),
            Event::Read(entries) => self.read(now, entries, &mut out),
            Event::Gone(gone) => {
                self.checking = false;
                if gone && self.phase == Phase::Searching && self.leading_enough() {
                    self.begin(&mut out);
                }
            }
        }
        out
    }

    fn tick(&mut self, now: Ms, out: &mut Vec<Action>) {
        if self.sticky_following() && now >= self.sticky_until() {
            // The leader did not take us in time: the usual way (once a request in flight
            // ends).
            self.fall_back(now, out);
        }
        if self.phase != Phase::Searching {
            return;
        }
        if now >= self.window_end {
            return self.close(out);
        }
        if self.sticky_following() && self.sticky_retry.is_some_and(|t| now >= t) {
            self.sticky_retry = None;
            if let Some(leader) = self.sticky_leader() {
                return self.ask(leader, out);
            }
        }
        if self.reading.is_none() && !self.full() && now >= self.next_read {
            self.reading = Some(now);
            out.push(Action::Read);
        }
    }

    /// The window ended with nobody to follow: begin with the followers if they are enough,
    /// else disband them and say whether anyone else was seen.
    fn close(&mut self, out: &mut Vec<Action>) {
        if !self.followers.is_empty() && self.followers.len() + 1 >= self.params.min_group_size {
            return self.begin(out);
        }
        self.disband(out);
        if self.params.min_group_size <= 1 {
            return self.begin(out);
        }
        self.phase = Phase::Done;
        out.push(Action::Finish(if self.saw_others {
            Outcome::Again
        } else {
            Outcome::Alone
        }));
    }

    fn join(&mut self, id: JoinId, info: MemberInfo, window_end: u64, out: &mut Vec<Action>) {
        self.saw_others = true;
        let reject = self.join_reply(&info, window_end);
        let ahead = info.tag > self.me.tag;
        if reject.is_none() {
            self.accepting.insert(id, info.clone());
        }
        out.push(Action::Reply { id, reject });
        if ahead {
            self.fall_behind(info.tag, out);
        }
    }

    /// Another peer searches with a greater round tag: this one is behind and ends its
    /// search now (letting its followers go), instead of waiting out a window for peers that
    /// are in another round.
    fn fall_behind(&mut self, theirs: u64, out: &mut Vec<Action>) {
        if !matches!(self.phase, Phase::Searching | Phase::Requesting { .. }) {
            return;
        }
        self.disband(out);
        self.phase = Phase::Done;
        out.push(Action::Finish(Outcome::Behind(theirs)));
    }

    /// How a searching peer answers a join request: `None` accepts it. Invalid requests,
    /// requests to a client (which never leads), from a non-client that ranks ahead of us (it
    /// read an old declaration), while we ask or follow someone, and past the target size are
    /// refused.
    fn join_reply(&self, info: &MemberInfo, window_end: u64) -> Option<RejectReason> {
        if Member::parse(info).is_err() {
            return Some(RejectReason::Invalid);
        }
        if info.tag != self.me.tag {
            return Some(RejectReason::OtherRound);
        }
        let ahead_of_us = rank(window_end, &info.peer_id) <= self.my_rank;
        let taken = self.followers.len() + self.accepting.len();
        if self.me.mode == AveragingMode::Client {
            Some(RejectReason::NotLeading)
        } else if info.mode != AveragingMode::Client
            && ahead_of_us
            && !(self.sticky_leading() && self.previous.contains(&info.peer_id))
        {
            // (A client never leads, so it may join whatever its rank.)
            Some(RejectReason::Stale)
        } else if matches!(self.phase, Phase::Following { .. }) {
            Some(RejectReason::NotLeading)
        } else if matches!(self.phase, Phase::Requesting { .. }) {
            Some(RejectReason::Busy)
        } else if taken + 1 >= self.params.target_group_size
            || self
                .followers
                .iter()
                .any(|(_, f)| f.peer_id == info.peer_id)
            || self.accepting.values().any(|f| f.peer_id == info.peer_id)
        {
            Some(RejectReason::Full)
        } else {
            None
        }
    }

    fn reply_sent(&mut self, now: Ms, id: JoinId, ok: bool, out: &mut Vec<Action>) {
        let Some(info) = self.accepting.remove(&id) else {
            return;
        };
        if !ok {
            return;
        }
        if self.phase != Phase::Searching {
            // (Cannot happen with a driver that reports the write before the next event; a
            // follower accepted while we left searching is let go.)
            out.push(Action::Disband {
                followers: vec![id],
            });
            return;
        }
        self.followers.push((id, info));
        if self.full()
            || (self.sticky_leading()
                && self.missing_from_last_group().is_some_and(|m| m.is_empty()))
        {
            return self.begin(out);
        }
        // Perhaps everyone searching has joined now: read the key at once rather than at the
        // next refresh (the read decides).
        if self.followers.len() + 1 >= self.params.min_group_size {
            self.next_read = now;
        }
    }

    fn asked(&mut self, now: Ms, leader: Vec<u8>, outcome: Asked, out: &mut Vec<Action>) {
        match &self.phase {
            Phase::Requesting { leader: l } | Phase::Following { leader: l } if *l == leader => {}
            _ => return,
        }
        self.phase = Phase::Searching;
        if self.sticky_following() {
            // Its leader is not searching yet, or no answer came: again shortly, while there is
            // time. Otherwise (busy with another group, full, another round, gone): the usual
            // way at once. (16 peers asking one leader together: a few requests a round were
            // dropped by libp2p-stream's accept channel, which holds one stream at a time, and
            // failed with yamux's "connection is closed"; each such member fell back, and its
            // search the usual way, going only to peers ranked ahead of it, all of them
            // following the leader, held the group up for 1-1.6 s.)
            let again = now + STICKY_RETRY_MS;
            match outcome {
                Asked::Grouped => {}
                Asked::NotSearching | Asked::Dropped if again < self.sticky_until() => {
                    self.sticky_retry = Some(again);
                    return;
                }
                _ => {
                    self.fall_back(now, out);
                    return;
                }
            }
        }
        // A member that fell back while asking its leader: the leader, not searching yet, will
        // be (it is not refused for the window like a leftover declaration).
        let outcome = match outcome {
            Asked::NotSearching if self.sticky.as_ref() == Some(&leader) => Asked::Busy,
            other => other,
        };
        match outcome {
            Asked::Grouped => {
                self.phase = Phase::Done;
                out.push(Action::Finish(Outcome::Followed));
                return;
            }
            // Disbanded: a leader that disbands to join an earlier peer, whose join then fails,
            // leads again; refusing it for the rest of the window left its ex-followers and it
            // unable to find each other (requests only go to earlier peers). Ask again after a
            // short pause instead.
            Asked::Disbanded | Asked::Busy | Asked::Dropped => {
                self.busy.insert(leader, now + self.params.busy_backoff_ms);
            }
            Asked::NotSearching | Asked::Refused(_) => {
                self.refused.insert(leader);
            }
        }
        // Try the next candidate now rather than at the next refresh: a refusal is often a
        // declaration left over from the previous round by a peer not searching yet. From the
        // last read while it is fresh, else from a new one. (No followers to disband: they
        // were when this request began, and joins are refused while it runs.)
        let next = self
            .last_read
            .as_ref()
            .filter(|(at, _)| now.saturating_sub(*at) < self.params.refresh_ms)
            .and_then(|(_, entries)| self.pick_leader(entries, now));
        match next {
            Some(leader) => self.ask(leader, out),
            None => self.next_read = now,
        }
        if now >= self.window_end && self.phase == Phase::Searching {
            self.close(out);
        }
    }

    fn read(&mut self, now: Ms, entries: Option<Vec<Declaration>>, out: &mut Vec<Action>) {
        // From the start of the last read (at once if it took longer): `first_refresh_ms`
        // after the first, doubling to `refresh_ms`.
        let started = self.reading.take().unwrap_or(now);
        self.next_read = started + self.refresh_wait;
        self.refresh_wait = (self.refresh_wait * 2).min(self.params.refresh_ms);
        let Some(entries) = entries else {
            return;
        };
        // Whether others search now: peers that found a group meanwhile closed their
        // declarations, and a peer left out by all of them is alone, not "again".
        self.saw_others = entries.iter().any(|d| d.info.peer_id != self.me.peer_id);
        // Peers in a later round: this one is behind. Peers in an earlier round will find out
        // the same way; neither kind can be in this peer's group.
        let ahead = entries.iter().map(|d| d.info.tag).max().unwrap_or(0);
        if ahead > self.me.tag {
            return self.fall_behind(ahead, out);
        }
        let entries: Vec<Declaration> = entries
            .into_iter()
            .filter(|d| d.info.tag == self.me.tag)
            .collect();
        let best = self.pick_leader(&entries, now);
        self.last_read = Some((now, entries));
        if self.phase != Phase::Searching || self.full() {
            return;
        }
        if let Some(leader) = best {
            // Also while leading a group that is not full: if an earlier peer is searching,
            // this group disbands and everyone joins that peer, so groups grow instead of
            // splitting when declarations reach peers at different times.
            self.disband(out);
            self.ask(leader, out);
        } else if self.leading_enough() {
            let missing = self.missing_declared();
            let graced = now.saturating_sub(self.opened) >= self.params.start_grace_ms;
            let check = match (missing.is_empty(), graced) {
                // Every declared peer joined: begin after the grace, or at once when the
                // whole previous group is here or gone.
                (true, true) => return self.begin(out),
                (true, false) => match self.missing_from_last_group() {
                    _ if !self.previous_was_everyone() => return,
                    Some(previous) if previous.is_empty() => return self.begin(out),
                    Some(previous) => Action::CheckGone {
                        connected: previous,
                        reachable: Vec::new(),
                    },
                    None => return,
                },
                // Declared peers that have not joined after the grace: begin without them if
                // they cannot be reached (a peer that died leaves its declaration until its
                // window ends; waiting for it cost every peer of the step a whole window).
                (false, true) => Action::CheckGone {
                    connected: Vec::new(),
                    reachable: missing,
                },
                (false, false) => return,
            };
            if !self.checking {
                self.checking = true;
                out.push(check);
            }
        }
    }

    /// Whether this peer leads followers enough to begin (at least one, and
    /// `min_group_size` with itself).
    fn leading_enough(&self) -> bool {
        let joined = self.followers.len();
        self.me.mode != AveragingMode::Client
            && joined > 0
            && joined + 1 >= self.params.min_group_size
    }

    /// The other peers of the last read that have not joined this peer.
    fn missing_declared(&self) -> Vec<MemberInfo> {
        self.last_read
            .as_ref()
            .map(|(_, entries)| {
                entries
                    .iter()
                    .map(|d| &d.info)
                    .filter(|i| i.peer_id != self.me.peer_id)
                    .filter(|i| !self.followers.iter().any(|(_, f)| f.peer_id == i.peer_id))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether the previous group held every peer expected to search (always, without a
    /// hint): only then may it begin again before the grace without the others.
    fn previous_was_everyone(&self) -> bool {
        self.params
            .swarm
            .is_none_or(|n| self.previous.len() + 1 >= n.min(self.params.target_group_size))
    }

    /// The members of the previous group (`None` before the first) that have not joined.
    fn missing_from_last_group(&self) -> Option<Vec<Vec<u8>>> {
        if self.previous.is_empty() {
            return None;
        }
        Some(
            self.previous
                .iter()
                .filter(|p| !self.followers.iter().any(|(_, f)| &f.peer_id == *p))
                .cloned()
                .collect(),
        )
    }

    /// The leader to ask among `entries` (live declarations under the key): the
    /// earliest-ranked non-client other than us that has not refused us, is not backed off
    /// from, and ranks ahead of us (so requests never form a cycle; a client never leads, so
    /// it asks the earliest leader whatever its own rank).
    fn pick_leader(&self, entries: &[Declaration], now: Ms) -> Option<Declaration> {
        entries
            .iter()
            .filter(|d| d.info.mode != AveragingMode::Client && d.info.peer_id != self.me.peer_id)
            .filter(|d| Member::parse(&d.info).is_ok())
            .filter(|d| {
                self.me.mode == AveragingMode::Client
                    || rank(d.window_end, &d.info.peer_id) < self.my_rank
            })
            .filter(|d| !self.refused.contains(&d.info.peer_id))
            .filter(|d| self.busy.get(&d.info.peer_id).is_none_or(|t| *t <= now))
            // The leader of a re-forming group does not go to its members while they may still
            // come to it (they ask it whatever their rank).
            .filter(|d| {
                !(self.sticky_leading()
                    && now < self.sticky_until()
                    && self.previous.contains(&d.info.peer_id))
            })
            .min_by(|a, b| {
                rank(a.window_end, &a.info.peer_id).cmp(&rank(b.window_end, &b.info.peer_id))
            })
            .cloned()
    }

    fn ask(&mut self, leader: Declaration, out: &mut Vec<Action>) {
        self.phase = Phase::Requesting {
            leader: leader.info.peer_id.clone(),
        };
        out.push(Action::Ask { leader });
    }

    fn disband(&mut self, out: &mut Vec<Action>) {
        if !self.followers.is_empty() {
            let followers = self.followers.drain(..).map(|(id, _)| id).collect();
            out.push(Action::Disband { followers });
        }
    }

    fn begin(&mut self, out: &mut Vec<Action>) {
        let mut members = vec![self.me.clone()];
        members.extend(self.followers.iter().map(|(_, f)| f.clone()));
        let followers = self.followers.drain(..).map(|(id, _)| id).collect();
        self.phase = Phase::Done;
        out.push(Action::Begin { followers, members });
        out.push(Action::Finish(Outcome::Led));
    }
}

mod sticky;
#[cfg(test)]
mod tests;
