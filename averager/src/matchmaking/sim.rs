//! A deterministic simulator of matchmaking in virtual time: many peers' [`Search`] state
//! machines, driven as the async shell drives them (window after window until a group or the
//! step's deadline), over a DHT whose stores become visible after a delay, links with
//! latencies (some slow), join requests, deaths and timeouts. No sockets and no sleeping: 64
//! peers through many steps run in well under a second.
//!
//! What it checks, step by step ([`Sim::check_step`]):
//! - every group's members agree: each live follower that was told `Begin` holds exactly the
//!   leader's round and member list, and no peer is in two groups of one step;
//! - no peer waits out a window while a group it could join exists: a peer whose window ends
//!   without a group (or that begins only when its window ends) had no other live peer
//!   searching alongside it long enough to find it.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use starling_node::Keypair;

use super::proto::{on_reject, Action, Asked, Event, JoinId, Ms, Outcome, Params, Search};
use crate::config::AveragingMode;
use crate::wire::{Declaration, MemberInfo, RejectReason};

/// The matchmaking window (`AveragerConfig::matchmaking_time`'s default).
const WINDOW_MS: Ms = 5000;
/// Bound on one request (`AveragerConfig::request_timeout`'s order).
const REQUEST_TIMEOUT_MS: Ms = 1000;
/// How long two live peers searching side by side take at most to find each other: a store
/// becoming visible, a read, the grace, a request and its answer over the slowest links.
const FIND_EACH_OTHER_MS: Ms = 1500;

/// A scenario.
#[derive(Debug, Clone)]
pub(super) struct Scenario {
    /// Peers in the swarm at the start.
    pub peers: usize,
    /// Peers that join the swarm during the run (a few per step).
    pub joiners: usize,
    /// Steps (one search per live peer each).
    pub steps: usize,
    /// Peers that die per step (at a random moment of its search).
    pub deaths_per_step: usize,
    /// Fraction of peers on slow links (ten times the latency).
    pub slow_fraction: f64,
    /// Group size limit.
    pub target_group_size: usize,
    /// The seed.
    pub seed: u64,
    /// Whether a group that held the whole swarm re-forms without reading the key
    /// ([`Search::sticky`]), as the averager does.
    pub sticky: bool,
    /// Fraction of join requests whose stream fails before the leader sees them (as libp2p's
    /// accept queue drops streams under a burst, or a connection closes): the asker gets no
    /// answer ([`Asked::Dropped`]).
    pub dropped_fraction: f64,
}

#[derive(Debug, Clone)]
enum Ev {
    /// The peer starts the step's search.
    Start(usize),
    /// Time for the peer's `next_wakeup` (window generation).
    Wake(usize, u64),
    /// A read of the key ends (window generation, the entries).
    ReadDone(usize, u64, Vec<Declaration>),
    /// A join request reaches the leader: (leader, follower, request number).
    JoinAt(usize, usize, u64),
    /// The leader's answer reaches the follower: (follower, leader, request, reject).
    Answer(usize, usize, u64, Option<RejectReason>),
    /// The leader's decision reaches the follower: (follower, leader, request, Begin or not).
    Decision(usize, usize, u64, Option<(u64, Vec<usize>)>),
    /// The request failed (a dead leader): (follower, leader, request).
    Fail(usize, usize, u64),
    /// The join request's stream failed before any answer: (follower, leader, request).
    Dropped(usize, usize, u64),
    /// The peer dies.
    Die(usize),
}

#[derive(Debug, Default, Clone)]
struct StepLog {
    started: Option<Ms>,
    ended: Option<Ms>,
    /// (round, members) of the group it ended in.
    group: Option<(u64, Vec<usize>)>,
    /// Windows it waited out (ended without a group, or began only at their end), with the
    /// time each ended.
    waited_out: Vec<Ms>,
}

struct Peer {
    info: MemberInfo,
    latency: Ms,
    alive: bool,
    /// In the swarm from this step on.
    from_step: usize,
    search: Option<Search>,
    generation: u64,
    window_end: Ms,
    /// Whether it declared in its current window (see `Search::declares_at_open`).
    declared: bool,
    deadline: Ms,
    /// The leader asked and the request's number.
    asking: Option<(usize, u64)>,
    /// When it sent its request in flight, and how long its last one took to be answered (as
    /// the shell measures: `Params::last_ask_ms`).
    asked_at: Ms,
    last_ask: Option<Ms>,
    requests: u64,
    /// Join requests this peer leads, by the id its search knows them by.
    joins: HashMap<JoinId, usize>,
    next_join: JoinId,
    previous: Vec<Vec<u8>>,
    /// The wake-up last scheduled.
    wake_at: Option<Ms>,
    log: StepLog,
}

/// The simulated swarm.
pub(super) struct Sim {
    scenario: Scenario,
    now: Ms,
    queue: BinaryHeap<Reverse<(Ms, u64)>>,
    events: HashMap<u64, Ev>,
    seq: u64,
    peers: Vec<Peer>,
    by_id: HashMap<Vec<u8>, usize>,
    /// Per peer, its stores to the group key: (visible from, declaration).
    dht: HashMap<usize, Vec<(Ms, Declaration)>>,
    rng: StdRng,
    /// Groups begun this step: (leader, round, members).
    groups: Vec<(usize, u64, Vec<usize>)>,
    /// Every violation found, in words.
    pub violations: Vec<String>,
    /// With `STARLING_SIM_TRACE=<peer>`: that peer's events and actions.
    trace: Option<(usize, Vec<String>)>,
    /// Totals over the run.
    pub grouped: usize,
    pub alone: usize,
    pub waited_out: usize,
    pub deaths: usize,
    /// DHT operations on the group key over the run: stores (declarations and closes), reads.
    pub stores: usize,
    pub reads: usize,
    /// Summed over the steps: from the moment the step's last live peer started its search
    /// until the last one of them ended it (how long the slowest group kept the step waiting).
    pub settle_ms: Ms,
    /// The live peers at the start of the step (what the training layer's progress tells the
    /// averager: [`Params::swarm`]).
    swarm_now: usize,
}

impl Sim {
    pub fn new(scenario: Scenario) -> Self {
        let mut rng = StdRng::seed_from_u64(scenario.seed);
        let total = scenario.peers + scenario.joiners;
        let mut peers = Vec::with_capacity(total);
        let mut by_id = HashMap::new();
        for i in 0..total {
            // Identities from the seed: runs are reproducible (ranks tie-break on peer ids).
            let mut secret: [u8; 32] = rng.gen();
            let key = Keypair::ed25519_from_bytes(&mut secret).expect("32 bytes");
            let info = MemberInfo {
                peer_id: key.public().to_peer_id().to_bytes(),
                mode: AveragingMode::Node,
                bandwidth: 1e8,
                addrs: vec![],
                tag: 0,
            };
            by_id.insert(info.peer_id.clone(), i);
            let slow = rng.gen_bool(scenario.slow_fraction);
            let from_step = if i < scenario.peers {
                0
            } else {
                rng.gen_range(1..scenario.steps.max(2))
            };
            peers.push(Peer {
                info,
                latency: if slow {
                    rng.gen_range(50..150)
                } else {
                    rng.gen_range(1..15)
                },
                alive: true,
                from_step,
                search: None,
                generation: 0,
                window_end: 0,
                declared: false,
                deadline: 0,
                asking: None,
                asked_at: 0,
                last_ask: None,
                requests: 0,
                joins: HashMap::new(),
                next_join: 0,
                previous: vec![],
                wake_at: None,
                log: StepLog::default(),
            });
        }
        Sim {
            scenario,
            now: 1_000_000,
            queue: BinaryHeap::new(),
            events: HashMap::new(),
            seq: 0,
            peers,
            by_id,
            dht: HashMap::new(),
            rng,
            groups: vec![],
            violations: vec![],
            trace: std::env::var("STARLING_SIM_TRACE")
                .ok()
                .and_then(|v| {
                    if v == "all" {
                        Some(usize::MAX)
                    } else {
                        v.parse().ok()
                    }
                })
                .map(|p| (p, vec![])),
            grouped: 0,
            alone: 0,
            waited_out: 0,
            deaths: 0,
            stores: 0,
            reads: 0,
            settle_ms: 0,
            swarm_now: 0,
        }
    }

    fn params(&self, p: usize) -> Params {
        Params {
            last_ask_ms: self.peers[p].last_ask,
            target_group_size: self.scenario.target_group_size,
            min_group_size: 2,
            start_grace_ms: 500,
            refresh_ms: 200,
            // As the averager reads: soon at first, then every refresh.
            first_refresh_ms: 25,
            busy_backoff_ms: 150,
            // What the training layer passes: the live peers of the swarm.
            swarm: Some(self.swarm_now),
        }
    }

    fn at(&mut self, t: Ms, ev: Ev) {
        self.seq += 1;
        self.events.insert(self.seq, ev);
        self.queue.push(Reverse((t.max(self.now), self.seq)));
    }

    fn link(&self, a: usize, b: usize) -> Ms {
        self.peers[a].latency + self.peers[b].latency
    }

    /// Runs every step; the violations are in [`Sim::violations`].
    pub fn run(&mut self) {
        for step in 0..self.scenario.steps {
            self.groups.clear();
            let start = self.now + 100;
            let live: Vec<usize> = (0..self.peers.len())
                .filter(|&i| self.peers[i].alive && self.peers[i].from_step <= step)
                .collect();
            self.swarm_now = live.len();
            for &i in &live {
                self.peers[i].log = StepLog::default();
                // Most reach the step together; a few late (within the grace or well after).
                let late = match self.rng.gen_range(0..20) {
                    0 => self.rng.gen_range(600..3000),
                    1..=3 => self.rng.gen_range(0..400),
                    _ => self.rng.gen_range(0..50),
                };
                self.at(start + late, Ev::Start(i));
            }
            let mut victims = live.clone();
            for _ in 0..self
                .scenario
                .deaths_per_step
                .min(live.len().saturating_sub(2))
            {
                let v = victims.swap_remove(self.rng.gen_range(0..victims.len()));
                let when = start + self.rng.gen_range(0..2500);
                self.at(when, Ev::Die(v));
            }
            while let Some(Reverse((t, seq))) = self.queue.pop() {
                self.now = t;
                if let Some(ev) = self.events.remove(&seq) {
                    self.handle(ev);
                }
            }
            self.check_step(step, &live);
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Start(p) if self.peers[p].alive => {
                let now = self.now;
                self.peers[p].log.started = Some(now);
                self.peers[p].deadline = now + 3 * WINDOW_MS;
                self.open_window(p, true);
            }
            Ev::Wake(p, g) if self.current(p, g) => {
                // The wake-up scheduled for now has come: a later one at the same time must be
                // scheduled anew (else a search that wants a tick now again never gets one).
                if self.peers[p].wake_at == Some(self.now) {
                    self.peers[p].wake_at = None;
                }
                self.feed(p, Event::Tick)
            }
            Ev::ReadDone(p, g, entries) if self.current(p, g) => {
                self.feed(p, Event::Read(Some(entries)))
            }
            Ev::JoinAt(l, f, req) => self.join_at(l, f, req),
            Ev::Answer(f, l, req, reject) if self.asking(f, l, req) => {
                let peer = &mut self.peers[f];
                peer.last_ask = Some(self.now - peer.asked_at);
                match reject {
                    None => self.feed(f, Event::Accepted),
                    Some(r) => self.asked(f, l, on_reject(r)),
                }
            }
            Ev::Decision(f, l, req, decision) if self.asking(f, l, req) => match decision {
                Some(group) => {
                    self.peers[f].log.group = Some(group);
                    self.asked(f, l, Asked::Grouped)
                }
                None => self.asked(f, l, Asked::Disbanded),
            },
            Ev::Dropped(f, l, req) if self.asking(f, l, req) => self.asked(f, l, Asked::Dropped),
            Ev::Fail(f, l, req) if self.asking(f, l, req) => {
                self.asked(f, l, Asked::Refused("the leader is gone".into()))
            }
            Ev::Die(p) if self.peers[p].alive => {
                self.deaths += 1;
                let peer = &mut self.peers[p];
                peer.alive = false;
                peer.search = None;
                // Its followers' streams close: they learn it after a link's latency.
                for f in 0..self.peers.len() {
                    if let Some((l, req)) = self.peers[f].asking {
                        if l == p && self.peers[f].alive {
                            let t = self.now + self.link(f, p);
                            self.at(t, Ev::Fail(f, p, req));
                        }
                    }
                }
            }
            _ => {}
        }
    }

    fn current(&self, p: usize, generation: u64) -> bool {
        let peer = &self.peers[p];
        peer.alive && peer.search.is_some() && peer.generation == generation
    }

    fn asking(&self, f: usize, l: usize, req: u64) -> bool {
        self.peers[f].alive && self.peers[f].asking == Some((l, req))
    }

    /// A window of the step's search (the shell's `find_group` loop): declare, then search (the
    /// step's first window may re-form the previous group, [`Search::sticky`]).
    fn open_window(&mut self, p: usize, first: bool) {
        let now = self.now;
        let end = (now + WINDOW_MS).min(self.peers[p].deadline);
        if end <= now + 50 {
            return self.finish(p);
        }
        let params = self.params(p);
        let peer = &mut self.peers[p];
        let mut search = Search::new(
            params,
            peer.info.clone(),
            end,
            peer.previous.clone(),
            now,
            end,
        );
        if first && self.scenario.sticky {
            search = search.sticky();
        }
        peer.window_end = end;
        peer.generation += 1;
        let declares = search.declares_at_open();
        peer.search = Some(search);
        peer.declared = false;
        if declares {
            self.declare(p);
        }
        self.feed(p, Event::Tick);
    }

    fn declare(&mut self, p: usize) {
        self.peers[p].declared = true;
        let decl = Declaration {
            info: self.peers[p].info.clone(),
            window_end: self.peers[p].window_end,
        };
        self.store(p, decl);
    }

    fn store(&mut self, p: usize, decl: Declaration) {
        self.stores += 1;
        let delay = self.rng.gen_range(5..60) + self.peers[p].latency;
        let t = self.now + delay;
        self.dht.entry(p).or_default().push((t, decl));
    }

    /// What a read started now returns: each peer's latest visible declaration, still open.
    fn read(&self) -> Vec<Declaration> {
        let now = self.now;
        self.dht
            .values()
            .filter_map(|versions| {
                // The DHT keeps the entry that expires last: each store expires later than
                // the one before (closing re-stores with a later expiration).
                versions
                    .iter()
                    .rev()
                    .find(|(visible, _)| *visible <= now)
                    .map(|(_, d)| d.clone())
            })
            .filter(|d| d.window_end > now)
            .collect()
    }

    fn note(&mut self, p: usize, what: String) {
        if let Some((who, log)) = self.trace.as_mut() {
            if *who == p || *who == usize::MAX {
                log.push(format!("{} [{p}] {what}", self.now % 100_000));
            }
        }
    }

    fn feed(&mut self, p: usize, event: Event) {
        let now = self.now;
        if self
            .trace
            .as_ref()
            .is_some_and(|(w, _)| *w == p || *w == usize::MAX)
        {
            let short = |id: &[u8]| self.by_id.get(id).copied();
            let what = match &event {
                Event::Join { info, .. } => format!("join from {:?}", short(&info.peer_id)),
                Event::Asked { leader, outcome } => {
                    format!("asked {:?}: {outcome:?}", short(leader))
                }
                Event::Read(Some(e)) => format!(
                    "read {:?}",
                    e.iter().map(|d| short(&d.info.peer_id)).collect::<Vec<_>>()
                ),
                other => format!("{other:?}"),
            };
            self.note(p, what);
        }
        let Some(search) = self.peers[p].search.as_mut() else {
            return;
        };
        let actions = search.handle(now, event);
        if self
            .trace
            .as_ref()
            .is_some_and(|(w, _)| *w == p || *w == usize::MAX)
        {
            let phase = format!(
                "{:?}",
                self.peers[p].search.as_ref().map(|s| s.phase().clone())
            );
            for a in &actions {
                let what = match a {
                    Action::Ask { leader } => {
                        format!("  -> ask {:?}", self.by_id.get(&leader.info.peer_id))
                    }
                    Action::Begin { members, .. } => format!("  -> begin with {}", members.len()),
                    Action::CheckGone {
                        connected,
                        reachable,
                    } => format!(
                        "  -> check gone {:?} {:?}",
                        connected
                            .iter()
                            .map(|c| self.by_id.get(c))
                            .collect::<Vec<_>>(),
                        reachable
                            .iter()
                            .map(|c| self.by_id.get(&c.peer_id))
                            .collect::<Vec<_>>()
                    ),
                    other => format!("  -> {other:?}"),
                };
                self.note(p, what);
            }
            self.note(p, format!("  phase {phase}"));
        }
        for action in actions {
            self.act(p, action);
        }
        if let Some(search) = self.peers[p].search.as_ref() {
            if let Some(t) = search.next_wakeup() {
                if self.peers[p].wake_at != Some(t) {
                    self.peers[p].wake_at = Some(t);
                    let g = self.peers[p].generation;
                    self.at(t, Ev::Wake(p, g));
                }
            }
        }
    }

    fn act(&mut self, p: usize, action: Action) {
        let now = self.now;
        match action {
            Action::Reply { id, reject } => {
                let Some(&f) = self.peers[p].joins.get(&id) else {
                    return;
                };
                let t = now + self.link(p, f);
                let req = self.peers[f].asking.map_or(0, |(_, r)| r);
                self.at(t, Ev::Answer(f, p, req, reject));
                if reject.is_none() {
                    let ok = self.peers[f].alive;
                    if !ok {
                        self.peers[p].joins.remove(&id);
                    }
                    self.feed(p, Event::ReplySent { id, ok });
                } else {
                    self.peers[p].joins.remove(&id);
                }
            }
            Action::Ask { leader } => {
                let Some(&l) = self.by_id.get(&leader.info.peer_id) else {
                    return;
                };
                let peer = &mut self.peers[p];
                peer.requests += 1;
                let req = peer.requests;
                peer.asking = Some((l, req));
                peer.asked_at = now;
                let t = now + self.link(p, l);
                self.at(t, Ev::JoinAt(l, p, req));
            }
            Action::Declare => self.declare(p),
            Action::Read => {
                self.reads += 1;
                let entries = self.read();
                let t = now + self.rng.gen_range(10..80) + 2 * self.peers[p].latency;
                let g = self.peers[p].generation;
                self.at(t, Ev::ReadDone(p, g, entries));
            }
            Action::CheckGone {
                connected,
                reachable,
            } => {
                // Connected or reachable: alive (the simulated links never drop a live peer).
                let gone = connected
                    .iter()
                    .chain(reachable.iter().map(|i| &i.peer_id))
                    .all(|id| self.by_id.get(id).is_none_or(|&q| !self.peers[q].alive));
                self.feed(p, Event::Gone(gone));
            }
            Action::Disband { followers } => {
                for id in followers {
                    if let Some(f) = self.peers[p].joins.remove(&id) {
                        let req = self.peers[f].asking.map_or(0, |(_, r)| r);
                        let t = now + self.link(p, f);
                        self.at(t, Ev::Decision(f, p, req, None));
                    }
                }
            }
            Action::Begin { followers, members } => {
                let round: u64 = self.rng.gen();
                let idx: Vec<usize> = members.iter().map(|m| self.by_id[&m.peer_id]).collect();
                if now >= self.peers[p].window_end {
                    self.peers[p].log.waited_out.push(now);
                }
                self.groups.push((p, round, idx.clone()));
                self.peers[p].log.group = Some((round, idx.clone()));
                for id in followers {
                    if let Some(f) = self.peers[p].joins.remove(&id) {
                        let req = self.peers[f].asking.map_or(0, |(_, r)| r);
                        let t = now + self.link(p, f);
                        self.at(t, Ev::Decision(f, p, req, Some((round, idx.clone()))));
                    }
                }
            }
            Action::Finish(outcome) => {
                // Followers still held (none in a correct machine) are let go.
                let rest: Vec<(JoinId, usize)> = self.peers[p].joins.drain().collect();
                for (_, f) in rest {
                    let req = self.peers[f].asking.map_or(0, |(_, r)| r);
                    let t = now + self.link(p, f);
                    self.at(t, Ev::Decision(f, p, req, None));
                }
                self.peers[p].search = None;
                self.peers[p].asking = None;
                match outcome {
                    Outcome::Led | Outcome::Followed => {
                        // Closed: re-stored with its window ended (if it declared).
                        if self.peers[p].declared {
                            let closed = Declaration {
                                info: self.peers[p].info.clone(),
                                window_end: now,
                            };
                            self.store(p, closed);
                        }
                        self.finish(p)
                    }
                    Outcome::Again => {
                        self.peers[p].log.waited_out.push(now);
                        self.open_window(p, false)
                    }
                    // (Every simulated peer searches with tag 0.)
                    Outcome::Alone | Outcome::Behind(_) => {
                        self.peers[p].log.waited_out.push(now);
                        self.finish(p)
                    }
                }
            }
        }
    }

    fn join_at(&mut self, l: usize, f: usize, req: u64) {
        if !self.peers[f].alive {
            return;
        }
        if !self.peers[l].alive {
            // Dialing a dead peer: the request times out.
            let t = self.now + REQUEST_TIMEOUT_MS;
            return self.at(t, Ev::Fail(f, l, req));
        }
        if self.scenario.dropped_fraction > 0.0 && self.rng.gen_bool(self.scenario.dropped_fraction)
        {
            let t = self.now + self.link(l, f);
            return self.at(t, Ev::Dropped(f, l, req));
        }
        if self.peers[l].search.is_none() {
            let t = self.now + self.link(l, f);
            return self.at(t, Ev::Answer(f, l, req, Some(RejectReason::NotSearching)));
        }
        let leader = &mut self.peers[l];
        let id = leader.next_join;
        leader.next_join += 1;
        leader.joins.insert(id, f);
        let (info, window_end) = (self.peers[f].info.clone(), self.peers[f].window_end);
        self.feed(
            l,
            Event::Join {
                id,
                info,
                window_end,
            },
        );
    }

    fn asked(&mut self, f: usize, l: usize, outcome: Asked) {
        let leader = self.peers[l].info.peer_id.clone();
        self.feed(f, Event::Asked { leader, outcome });
        if self.peers[f].search.is_some() {
            // Not in a group: no longer asking that leader (the search asked another, or not).
            if self.peers[f].asking.is_some_and(|(x, _)| x == l) {
                self.peers[f].asking = None;
            }
        }
    }

    fn finish(&mut self, p: usize) {
        let now = self.now;
        let previous: Option<Vec<Vec<u8>>> = self.peers[p].log.group.as_ref().map(|(_, ms)| {
            ms.iter()
                .filter(|&&m| m != p)
                .map(|&m| self.peers[m].info.peer_id.clone())
                .collect()
        });
        let peer = &mut self.peers[p];
        peer.search = None;
        peer.asking = None;
        peer.log.ended = Some(now);
        if let Some(previous) = previous {
            peer.previous = previous;
        }
    }

    /// The step's checks (see the module docs).
    fn check_step(&mut self, step: usize, live: &[usize]) {
        let logs = || live.iter().map(|&p| &self.peers[p].log);
        let last_start = logs().filter_map(|l| l.started).max();
        let last_end = logs().filter_map(|l| l.ended).max();
        if let (Some(s), Some(e)) = (last_start, last_end) {
            self.settle_ms += e.saturating_sub(s);
        }
        let mut member_of: HashMap<usize, u64> = HashMap::new();
        for (leader, round, members) in &self.groups {
            if members.len() > self.scenario.target_group_size || members.len() < 2 {
                self.violations.push(format!(
                    "step {step}: group {round} of {} members",
                    members.len()
                ));
            }
            for &m in members {
                if let Some(other) = member_of.insert(m, *round) {
                    self.violations.push(format!(
                        "step {step}: peer {m} in groups {other} and {round}"
                    ));
                }
                let peer = &self.peers[m];
                if m != *leader && peer.alive {
                    if let Some((r, ms)) = &peer.log.group {
                        if r != round || ms != members {
                            self.violations.push(format!(
                                "step {step}: peer {m} holds group {r} {ms:?}, its leader {leader} began {round} {members:?}"
                            ));
                        }
                    }
                }
            }
        }
        for &p in live {
            let log = self.peers[p].log.clone();
            if !self.peers[p].alive {
                continue;
            }
            if log.group.is_some() {
                self.grouped += 1;
            } else {
                self.alone += 1;
            }
            self.waited_out += log.waited_out.len();
            for &ended in &log.waited_out {
                let window_start = ended.saturating_sub(WINDOW_MS);
                // Another live peer searching alongside this one long enough to find it.
                let partner = live.iter().copied().find(|&q| {
                    let other = &self.peers[q].log;
                    q != p
                        && self.peers[q].alive
                        && other.started.is_some_and(|s| {
                            let from = s.max(window_start).max(log.started.unwrap_or(0));
                            let to = other.ended.unwrap_or(Ms::MAX).min(ended);
                            to > from + FIND_EACH_OTHER_MS
                        })
                });
                if let Some(q) = partner {
                    self.violations.push(format!(
                        "step {step}: peer {p} waited out a window ending at {ended} while peer {q} searched alongside (its group: {:?})",
                        self.peers[q].log.group.as_ref().map(|(r, _)| r)
                    ));
                }
            }
        }
    }
}

mod tests;
