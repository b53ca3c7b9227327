//! Matchmaking: forming a group through the DHT (the protocol is explained in the crate docs,
//! "Matchmaking"). One search runs per step; its join requests arrive through the
//! [`Router`](crate::router::Router) and leave through the [`Transport`].

mod proto;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use starling_dht::now_ms;
use starling_node::streams::{open_confirmed, Retry};
use starling_node::{NodeError, PeerId};
use tokio::sync::mpsc;
use tokio::time::{sleep_until, timeout, timeout_at, Instant};
use tracing::Instrument;

use crate::config::{AveragerConfig, Fault};
use crate::group::{Group, Member};
use crate::router::{IncomingJoin, Router};
use crate::transport::Transport;
use crate::verify::Banned;
use crate::wire::{
    read_control, write_control, Control, Declaration, MatchMsg, MemberIdx, MemberInfo, ReduceMsg,
    RejectReason, MATCHMAKING_PROTOCOL, MAX_CONTROL_BYTES, REDUCE_PROTOCOL,
};
use crate::AveragerError;
use proto::{Action, Asked, Event, JoinId, Ms, Outcome, Params, Search};

/// How often a searching peer re-reads the group key.
const REFRESH_INTERVAL: Duration = Duration::from_millis(200);
/// The wait before a window's second read of the key (doubling to [`REFRESH_INTERVAL`]).
const FIRST_REFRESH: Duration = Duration::from_millis(25);
/// How long a peer that answered `Busy` is left alone.
const BUSY_BACKOFF: Duration = Duration::from_millis(150);
/// What matchmaking works with: the configuration, the router its join requests arrive
/// through, and the transport it reaches leaders with.
#[derive(Clone)]
pub(crate) struct Matchmaker {
    pub config: Arc<AveragerConfig>,
    pub router: Router,
    pub transport: Transport,
    /// The other members of this peer's previous group (empty before its first).
    pub previous: Vec<PeerId>,
    /// The latest expiration this peer gave a declaration (unix ms; shared across rounds).
    pub declared_until: Arc<std::sync::atomic::AtomicU64>,
    /// How long this peer's last join request took to be answered, in ms (`u64::MAX` before
    /// the first; shared across rounds; see `Search::declares_at_open`).
    pub last_ask_ms: Arc<std::sync::atomic::AtomicU64>,
    /// The peers expected to search (`Averager::expect_peers`), if the caller said.
    pub expected: Option<usize>,
    /// Peers proven to have lied: never grouped with (see [`crate::verify`]).
    pub banned: Banned,
}

/// Why asking a leader to take us did not end in a group.
enum FollowError {
    /// Try this leader again shortly.
    Busy,
    /// The request's stream failed before an answer ([`Asked::Dropped`]).
    Dropped,
    /// The leader is not searching under the key.
    NotSearching,
    /// Do not ask this leader again in this search.
    Refused(String),
}

type FollowFuture = BoxFuture<'static, (Vec<u8>, Result<Option<Group>, FollowError>)>;

/// Searches until a group forms or `deadline` passes.
pub(crate) async fn find_group(
    mm: &Matchmaker,
    group_key: &str,
    me: MemberInfo,
    deadline: Instant,
) -> Result<Group, AveragerError> {
    let started = Instant::now();
    let (_registration, mut rx) = mm.router.register_search(group_key);
    let cfg = &mm.config;
    let node = mm.transport.node();
    let subkey = node.owner_marker();
    // Only the first window may re-form the previous group without reading the key.
    let mut first = true;
    loop {
        let now = Instant::now();
        let window_end = (now + cfg.matchmaking_time).min(deadline);
        if window_end <= now + Duration::from_millis(50) {
            return Err(AveragerError::NoGroup {
                min: cfg.min_group_size,
                searched_ms: started.elapsed().as_millis() as u64,
                alone: false,
            });
        }
        let window_end_ms = now_ms() + (window_end - now).as_millis() as u64;
        // A window that ended in a group, or behind another round: nobody should wait for
        // this peer's declaration any longer.
        let close = || {
            let closed_until = mm.declared_until.fetch_add(1, Ordering::AcqRel) + 1;
            close_declaration(
                node,
                group_key,
                &subkey,
                &me,
                closed_until,
                cfg.request_timeout,
            );
        };
        let sticky = std::mem::replace(&mut first, false);
        // Whether this window declared this peer (a member of a re-forming group may not).
        let mut declared = false;
        let window = run_window(
            mm,
            group_key,
            &me,
            (window_end, window_end_ms),
            sticky,
            &mut rx,
            &mut declared,
        )
        .await?;
        match window {
            Window::Group(group) => {
                // A tagged round's group that holds every peer the caller expects to search
                // (`Averager::expect_peers`) leaves its declaration open: nobody else searches
                // under this tag, and this peer's next search (another tag) replaces it. Closing
                // it was one more DHT write per round that no peer read (a pair of glyphs MLP
                // peers, a core each: 0.72 -> 0.68 of the lone peer's time, six runs each).
                if declared && !holds_everyone(&group, me.tag, mm.expected) {
                    close();
                }
                return Ok(group);
            }
            Window::Again => {}
            Window::Behind(theirs) => {
                if declared {
                    close();
                }
                return Err(AveragerError::Behind {
                    mine: me.tag,
                    theirs,
                });
            }
            // Nobody else searched under this key for a whole window: searching on until the
            // deadline would only hold the caller up (e.g. the odd peer out of a full grid key).
            Window::Alone => {
                return Err(AveragerError::NoGroup {
                    min: cfg.min_group_size,
                    searched_ms: started.elapsed().as_millis() as u64,
                    alone: true,
                })
            }
        }
    }
}

/// Whether `group` formed in a tagged round (`tag` not 0, see `Averager::set_round_tag`) and
/// holds every peer expected to search (`expected`, this one included): then no other peer
/// searches under the key with this tag, and a declaration left open misleads nobody. Untagged
/// rounds always close theirs: the next round's search reads the same key with the same tag.
fn holds_everyone(group: &Group, tag: u64, expected: Option<usize>) -> bool {
    tag != 0 && expected.is_some_and(|n| n > 1 && group.members.len() >= n)
}

/// How a search window ended.
enum Window {
    /// In a group.
    Group(Group),
    /// Others searched too but no group formed: search again.
    Again,
    /// No other peer searched under the key during the whole window.
    Alone,
    /// Another peer searched with this greater round tag.
    Behind(u64),
}

/// A short printable form of a peer id, for logs.
fn short(peer: &[u8]) -> String {
    PeerId::from_bytes(peer)
        .map(|p| p.to_string())
        .unwrap_or_default()
        .chars()
        .rev()
        .take(6)
        .collect()
}

/// The settings of [`proto::Search`] from the averager's.
fn params(cfg: &AveragerConfig, swarm: Option<usize>, last_ask_ms: u64) -> Params {
    Params {
        swarm,
        last_ask_ms: (last_ask_ms != u64::MAX).then_some(last_ask_ms),
        target_group_size: cfg.target_group_size,
        min_group_size: cfg.min_group_size,
        start_grace_ms: cfg.effective_start_grace().as_millis() as Ms,
        refresh_ms: REFRESH_INTERVAL.as_millis() as Ms,
        first_refresh_ms: FIRST_REFRESH.as_millis() as Ms,
        busy_backoff_ms: BUSY_BACKOFF.as_millis() as Ms,
    }
}

/// Declares this peer under `group_key` until `window_end_ms`, under its owner marker: signed
/// by the node, so nobody else can overwrite it. The DHT keeps the entry that expires last, so
/// this one must outlive every entry this peer wrote before under the key, closed ones included
/// (a window cut short by the deadline can end before the last one did); readers go by
/// `window_end`, not by the expiration. A failed store is logged (the search goes on: others
/// may still find this peer through its join requests); only a closed node is an error.
async fn declare(
    mm: &Matchmaker,
    group_key: &str,
    me: &MemberInfo,
    window_end_ms: u64,
) -> Result<(), AveragerError> {
    let node = mm.transport.node();
    let declaration = Declaration {
        info: me.clone(),
        window_end: window_end_ms,
    };
    let expiration = window_end_ms.max(mm.declared_until.load(Ordering::Acquire) + 1);
    mm.declared_until.fetch_max(expiration, Ordering::AcqRel);
    match timeout(
        mm.config.request_timeout,
        node.store(group_key, &node.owner_marker(), &declaration, expiration),
    )
    .await
    .unwrap_or(Err(NodeError::Timeout("declare")))
    {
        Ok(_) => Ok(()),
        Err(NodeError::Closed) => Err(NodeError::Closed.into()),
        Err(e) => {
            tracing::debug!("declaring under {group_key}: {e}");
            Ok(())
        }
    }
}

/// One search window: drives the pure state machine of [`proto`] (which decides) with the
/// router's join requests, the request to a leader, DHT reads and the clock, and carries out
/// its actions on streams. `sticky`: the window may re-form the previous group without reads
/// ([`Search::sticky`]).
async fn run_window(
    mm: &Matchmaker,
    group_key: &str,
    me: &MemberInfo,
    (window_end, window_end_ms): (Instant, u64),
    sticky: bool,
    rx: &mut mpsc::Receiver<IncomingJoin>,
    declared: &mut bool,
) -> Result<Window, AveragerError> {
    let cfg = &mm.config;
    let node = mm.transport.node();
    let origin = Instant::now();
    let clock = move || origin.elapsed().as_millis() as Ms;
    let previous = mm.previous.iter().map(|p| p.to_bytes()).collect();
    let end = window_end.saturating_duration_since(origin).as_millis() as Ms;
    let mut search = Search::new(
        params(cfg, mm.expected, mm.last_ask_ms.load(Ordering::Acquire)),
        me.clone(),
        window_end_ms,
        previous,
        0,
        end,
    );
    // The leader of a re-forming group must be up (a crashed one is found down
    // at once; asking it would cost its members a request timeout).
    if sticky && !mm.previous.iter().any(|p| node.is_down(p)) {
        search = search.sticky();
    }
    if search.declares_at_open() {
        declare(mm, group_key, me, window_end_ms).await?;
        *declared = true;
    }
    // Join requests by the id the state machine knows them by: waiting for their answer, or
    // accepted (followers, answered again at begin or disband).
    let mut joins: HashMap<JoinId, IncomingJoin> = HashMap::new();
    let mut next_id: JoinId = 0;
    let mut attempt: Option<FollowFuture> = None;
    // Set by the request in flight once its leader accepted us.
    let mut accepted = Arc::new(AtomicBool::new(false));
    let mut formed: Option<Group> = None;
    let mut pending: VecDeque<Action> = search.handle(clock(), Event::Tick).into();
    loop {
        while let Some(action) = pending.pop_front() {
            match action {
                Action::Reply { id, reject } => {
                    let Some(mut join) = joins.remove(&id) else {
                        continue;
                    };
                    let msg = match reject {
                        Some(r) => MatchMsg::Rejected(r),
                        None => MatchMsg::Accepted,
                    };
                    let sent =
                        timeout(cfg.request_timeout, write_control(&mut join.stream, &msg)).await;
                    tracing::trace!(me = %short(&me.peer_id), from = %short(&join.info.peer_id), ?reject, "join request");
                    if reject.is_none() {
                        let ok = matches!(sent, Ok(Ok(_)));
                        if ok {
                            if cfg.fault()
                                == Some(Fault::LeaderAfterFollowers(search.followers() + 1))
                            {
                                node.shutdown().await;
                                return Err(NodeError::Closed.into());
                            }
                            joins.insert(id, join);
                        }
                        pending.extend(search.handle(clock(), Event::ReplySent { id, ok }));
                    }
                }
                Action::Ask { leader } => {
                    tracing::trace!(me = %short(&me.peer_id), leader = %short(&leader.info.peer_id), "asking to join");
                    (accepted, attempt) = ask(mm, group_key, me, window_end_ms, leader);
                }
                Action::Declare => {
                    if !*declared {
                        declare(mm, group_key, me, window_end_ms).await?;
                        *declared = true;
                    }
                }
                Action::Read => {
                    let read = read_declarations(node, group_key, cfg.request_timeout)
                        .await?
                        .map(|found| {
                            found
                                .into_iter()
                                .filter(|d| !mm.banned.contains(&d.info.peer_id))
                                // A declaration left by a peer that crashed: nobody to
                                // wait for (see `Node::is_down`).
                                .filter(|d| {
                                    PeerId::from_bytes(&d.info.peer_id)
                                        .map_or(true, |p| !node.is_down(&p))
                                })
                                .collect()
                        });
                    pending.extend(search.handle(clock(), Event::Read(read)));
                }
                Action::CheckGone {
                    connected,
                    reachable,
                } => {
                    let gone = all_gone(node, &connected, &reachable, cfg.request_timeout).await;
                    pending.extend(search.handle(clock(), Event::Gone(gone)));
                }
                Action::Disband { followers } => {
                    let mut let_go: Vec<IncomingJoin> =
                        followers.iter().filter_map(|id| joins.remove(id)).collect();
                    disband(&mut let_go, cfg.request_timeout).await;
                }
                Action::Begin { followers, members } => {
                    tracing::debug!(me = %short(&me.peer_id), followers = followers.len(), "beginning");
                    let told: Vec<IncomingJoin> =
                        followers.iter().filter_map(|id| joins.remove(id)).collect();
                    formed = Some(begin(cfg, members, told).await?);
                }
                Action::Finish(outcome) => {
                    tracing::trace!(me = %short(&me.peer_id), ?outcome, "window ended");
                    let mut rest: Vec<IncomingJoin> = joins.drain().map(|(_, j)| j).collect();
                    disband(&mut rest, cfg.request_timeout).await;
                    return Ok(match (outcome, formed) {
                        (Outcome::Led | Outcome::Followed, Some(group)) => Window::Group(group),
                        (Outcome::Led | Outcome::Followed, None) => {
                            return Err(AveragerError::Protocol(
                                "matchmaking ended in a group it does not hold".into(),
                            ))
                        }
                        (Outcome::Again, _) => Window::Again,
                        (Outcome::Alone, _) => Window::Alone,
                        (Outcome::Behind(theirs), _) => Window::Behind(theirs),
                    });
                }
            }
        }
        let wake = search
            .next_wakeup()
            .map(|ms| origin + Duration::from_millis(ms));
        tokio::select! {
            _ = sleep_until(wake.unwrap_or(origin)), if wake.is_some() => {
                pending.extend(search.handle(clock(), Event::Tick));
            }
            Some(join) = rx.recv() => {
                if mm.banned.contains(&join.info.peer_id) {
                    refuse_banned(join, cfg.request_timeout);
                    continue;
                }
                if accepted.load(Ordering::Acquire) {
                    pending.extend(search.handle(clock(), Event::Accepted));
                }
                let (id, info, window_end) = (next_id, join.info.clone(), join.window_end);
                next_id += 1;
                joins.insert(id, join);
                pending.extend(search.handle(clock(), Event::Join { id, info, window_end }));
            }
            (leader, result) = async { attempt.as_mut().expect("guarded").await }, if attempt.is_some() => {
                attempt = None;
                let outcome = match result {
                    Ok(Some(group)) => {
                        formed = Some(group);
                        Asked::Grouped
                    }
                    Ok(None) => Asked::Disbanded,
                    Err(FollowError::Busy) => {
                        tracing::trace!(me = %short(&me.peer_id), "leader busy");
                        Asked::Busy
                    }
                    Err(FollowError::Dropped) => Asked::Dropped,
                    Err(FollowError::NotSearching) => Asked::NotSearching,
                    Err(FollowError::Refused(why)) => {
                        tracing::trace!(me = %short(&me.peer_id), "join refused: {why}");
                        Asked::Refused(why)
                    }
                };
                pending.extend(search.handle(clock(), Event::Asked { leader, outcome }));
            }
        }
    }
}

/// Whether all these peers are gone: none of `connected` has a connection open (a stable
/// group, or one that lost a member whose connection closed, begins at once; a previous member
/// still connected but not yet searching is waited for), and none of `reachable` is connected
/// or answers a dial within `limit` (a declared peer this one never talked to may not have
/// dialed yet; a dead one cannot be reached).
async fn all_gone(
    node: &starling_node::Node,
    connected: &[Vec<u8>],
    reachable: &[MemberInfo],
    limit: Duration,
) -> bool {
    let Ok(open) = node.connected_peers().await else {
        return false;
    };
    let is_open = |p: &[u8]| PeerId::from_bytes(p).is_ok_and(|id| open.contains(&id));
    if connected.iter().any(|p| is_open(p)) || reachable.iter().any(|i| is_open(&i.peer_id)) {
        return false;
    }
    let dials = reachable.iter().filter_map(|info| {
        let member = Member::parse(info).ok()?;
        Some(async move {
            timeout(limit, node.connect_if_needed(member.peer, &member.addrs))
                .await
                .is_ok_and(|r| r.unwrap_or(false))
        })
    });
    !futures::future::join_all(dials)
        .await
        .into_iter()
        .any(|up| up)
}

/// The declarations under `group_key` written by the peers they declare; `None` when the
/// lookup failed or timed out (try again at the next refresh).
async fn read_declarations(
    node: &starling_node::Node,
    group_key: &str,
    limit: Duration,
) -> Result<Option<Vec<Declaration>>, AveragerError> {
    let entries = match timeout(limit, node.get::<Declaration>(group_key)).await {
        Ok(Ok(entries)) => entries,
        Ok(Err(NodeError::Closed)) => return Err(NodeError::Closed.into()),
        _ => return Ok(None),
    };
    let total = entries.len();
    let genuine: Vec<Declaration> = entries
        .into_iter()
        .filter(|(subkey, d, _)| declared_by_its_peer(group_key, subkey, d))
        .map(|(_, d, _)| d)
        .collect();
    if genuine.len() < total {
        tracing::debug!(
            ignored = total - genuine.len(),
            "ignoring declarations under {group_key} not written under the declared peer's owner marker"
        );
    }
    // Closed declarations (their peer is in a group: `close_declaration`) are not searching.
    let now = now_ms();
    let genuine = genuine.into_iter().filter(|d| d.window_end > now).collect();
    Ok(Some(genuine))
}

/// Replaces this peer's declaration under `group_key` (in the background) with one whose window
/// has ended: it is in a group, so leaders still searching under the key stop counting on it
/// (they begin with everyone still searching instead of waiting out their window). The DHT keeps
/// the entry with the later expiration: `expiration` is one millisecond past the declaration's.
fn close_declaration(
    node: &starling_node::Node,
    group_key: &str,
    subkey: &str,
    me: &MemberInfo,
    expiration: u64,
    limit: Duration,
) {
    let closed = Declaration {
        info: me.clone(),
        window_end: now_ms(),
    };
    let (node, key, subkey) = (node.clone(), group_key.to_string(), subkey.to_string());
    tokio::spawn(
        async move {
            let stored = timeout(limit, node.store(&key, &subkey, &closed, expiration)).await;
            if let Ok(Err(e)) = stored {
                tracing::debug!("closing the declaration under {key}: {e}");
            }
        }
        .in_current_span(),
    );
}

/// Whether a declaration read under `(group_key, subkey)` was written by the peer it declares:
/// the sub-key is an owner marker (the DHT only holds it with that owner's valid signature)
/// whose key is the identity of `declaration.info.peer_id`.
fn declared_by_its_peer(group_key: &str, subkey: &str, declaration: &Declaration) -> bool {
    let Ok(Some(owner)) = starling_dht::required_owner(group_key, subkey) else {
        return false;
    };
    let declared = PeerId::from_bytes(&declaration.info.peer_id).ok();
    declared.is_some() && starling_node::peer_id_of_owner(&owner) == declared
}

/// Tells every follower to search again, and lets them go.
async fn disband(followers: &mut Vec<IncomingJoin>, each: Duration) {
    for f in followers.iter_mut() {
        let _ = timeout(each, async {
            write_control(&mut f.stream, &MatchMsg::Disband).await?;
            // Close (FIN) rather than drop (RST), so the message is never discarded in flight.
            futures::AsyncWriteExt::close(&mut f.stream).await?;
            Ok::<_, AveragerError>(())
        })
        .await;
    }
    followers.clear();
}

/// The leader's move: tell every follower the member list (the leader first, then the
/// followers in order), and return the group.
async fn begin(
    cfg: &AveragerConfig,
    members: Vec<MemberInfo>,
    mut followers: Vec<IncomingJoin>,
) -> Result<Group, AveragerError> {
    let round_id: u64 = rand::random();
    let msg = MatchMsg::Begin {
        round_id,
        members: members.clone(),
    };
    let timeout_each = cfg.request_timeout;
    futures::future::join_all(followers.iter_mut().map(|f| async {
        let sent = timeout(timeout_each, async {
            write_control(&mut f.stream, &msg).await?;
            // Close (FIN) rather than drop (RST), so the message is never discarded in flight.
            futures::AsyncWriteExt::close(&mut f.stream).await?;
            Ok::<_, AveragerError>(())
        })
        .await;
        if !matches!(sent, Ok(Ok(()))) {
            tracing::debug!("follower missed the begin message");
        }
    }))
    .await;
    // Every member's peer id was checked against its connection when it joined.
    Group::new(round_id, &members, 0).map_err(AveragerError::Protocol)
}

/// Starts asking `leader` to take us: the flag [`follow`] sets once the leader accepted, and
/// the request (for `run_window`'s `following` and `attempt`).
fn ask(
    mm: &Matchmaker,
    group_key: &str,
    me: &MemberInfo,
    my_window_end: u64,
    leader: Declaration,
) -> (Arc<AtomicBool>, Option<FollowFuture>) {
    let accepted = Arc::new(AtomicBool::new(false));
    let asking = follow(
        mm.clone(),
        group_key.to_string(),
        me.clone(),
        my_window_end,
        leader,
        accepted.clone(),
    );
    (accepted, Some(asking.in_current_span().boxed()))
}

async fn follow(
    mm: Matchmaker,
    group_key: String,
    me: MemberInfo,
    my_window_end: u64,
    leader: Declaration,
    accepted: Arc<AtomicBool>,
) -> (Vec<u8>, Result<Option<Group>, FollowError>) {
    let id = leader.info.peer_id.clone();
    let result = follow_inner(&mm, group_key, me, my_window_end, leader, accepted).await;
    (id, result)
}

async fn follow_inner(
    mm: &Matchmaker,
    group_key: String,
    me: MemberInfo,
    my_window_end: u64,
    leader: Declaration,
    accepted: Arc<AtomicBool>,
) -> Result<Option<Group>, FollowError> {
    let cfg = &mm.config;
    let refused = |e: &dyn std::fmt::Display| FollowError::Refused(e.to_string());
    let dropped = |what: &str, e: &dyn std::fmt::Display| {
        tracing::trace!("join request {what}: {e}");
        FollowError::Dropped
    };
    let leader_member = Member::parse(&leader.info).map_err(|e| refused(&e))?;
    // How long the request takes to be answered, or to fail (a request that timed out was
    // slow too): whether this peer's next windows may leave their declaration out
    // (`Search::declares_at_open`).
    let asked_at = Instant::now();
    let answer = async {
        let mut stream = mm
            .transport
            .open_stream(
                leader_member.peer,
                &leader_member.addrs,
                MATCHMAKING_PROTOCOL,
            )
            .await
            .map_err(|e| refused(&e))?;
        let join = MatchMsg::Join {
            group_key,
            info: me.clone(),
            window_end: my_window_end,
        };
        // A stream that fails before any answer was most likely dropped by libp2p-stream's
        // accept queue under a burst of requests: ask again shortly rather than giving up on
        // this leader. (A leader that is really gone stops being a candidate when its
        // declaration expires.)
        timeout(cfg.request_timeout, write_control(&mut stream, &join))
            .await
            .map_err(|e| refused(&e))?
            .map_err(|e| dropped("not written", &e))?;
        let reply: MatchMsg = timeout(cfg.request_timeout, read_control(&mut stream))
            .await
            .map_err(|e| refused(&e))?
            .map_err(|e| dropped("not answered", &e))?;
        Ok::<_, FollowError>((stream, reply))
    }
    .await;
    mm.last_ask_ms
        .store(asked_at.elapsed().as_millis() as u64, Ordering::Release);
    let (mut stream, reply) = answer?;
    match reply {
        MatchMsg::Accepted => accepted.store(true, Ordering::Release),
        MatchMsg::Rejected(reason) => {
            tracing::trace!(?reason, "join request rejected");
            return Err(match proto::on_reject(reason) {
                Asked::Busy => FollowError::Busy,
                Asked::NotSearching => FollowError::NotSearching,
                _ => FollowError::Refused(format!("{reason:?}")),
            });
        }
        other => return Err(FollowError::Refused(format!("{other:?}"))),
    }
    // Wait for the leader's decision, at most until its window closes (plus slack).
    // The leader's window end comes from the network: bounded, so a lie cannot hold us (or
    // overflow the clock) past two of our own windows.
    let wait = Duration::from_millis(leader.window_end.saturating_sub(now_ms()))
        .min(cfg.matchmaking_time * 2);
    let until = Instant::now() + wait + cfg.request_timeout;
    let decision: MatchMsg = timeout_at(until, read_control(&mut stream))
        .await
        .map_err(|_| FollowError::Refused("leader did not begin in time".into()))?
        .map_err(|e| refused(&e))?;
    match decision {
        MatchMsg::Begin { round_id, members } => {
            let my_index = members
                .iter()
                .position(|m| m.peer_id == me.peer_id)
                .ok_or_else(|| FollowError::Refused("begin message does not list us".into()))?;
            if members.len() > cfg.target_group_size.max(256)
                || members[0].peer_id != leader.info.peer_id
            {
                return Err(FollowError::Refused("malformed begin message".into()));
            }
            if members.iter().any(|m| mm.banned.contains(&m.peer_id)) {
                // The leader had not learned of the liar yet: the other members are told now,
                // or they would wait for this peer's part and span until their timeouts.
                decline(mm, round_id, &members, my_index);
                return Err(FollowError::Refused(
                    "the group holds a peer proven to have lied".into(),
                ));
            }
            // Peer ids are parsed once, here: a malformed one refuses the group.
            Group::new(round_id, &members, my_index)
                .map(Some)
                .map_err(|e| FollowError::Refused(format!("malformed begin message: {e}")))
        }
        MatchMsg::Disband => Ok(None),
        other => Err(FollowError::Refused(format!("unexpected {other:?}"))),
    }
}

/// Tells the members of round `round_id` that this peer, listed at `my_index`, takes no part
/// in it: each gets one [`ReduceMsg::Declined`] (in the background, each send bounded by the
/// request timeout), and this peer's router answers the round's hellos at once. The liar is
/// told too: the honest members that go on with it wait for its span, which it reduces only
/// once it stops waiting for this peer's part.
fn decline(mm: &Matchmaker, round_id: u64, members: &[MemberInfo], my_index: usize) {
    mm.router.decline(round_id);
    let limit = mm.config.request_timeout;
    let msg = ReduceMsg::Declined {
        round_id,
        sender: MemberIdx::of(my_index),
    };
    for (i, info) in members.iter().enumerate() {
        if i == my_index {
            continue;
        }
        let Ok(member) = Member::parse(info) else {
            continue;
        };
        let (transport, msg) = (mm.transport.clone(), msg.clone());
        let tell = async move {
            // Its answer is awaited (and a stream dropped by a busy accept queue sent again),
            // so that the frame is read before the stream closes.
            let told = open_confirmed::<_, _, _, _, _, Control<ReduceMsg>>(
                || transport.open_stream(member.peer, &member.addrs, REDUCE_PROTOCOL),
                &Control::Control(&msg),
                MAX_CONTROL_BYTES + 1,
                Instant::now() + limit,
                Retry::default(),
            )
            .await;
            if let Err(e) = told {
                tracing::debug!(peer = %member.peer, "telling a member this peer declined: {e}");
            }
        };
        tokio::spawn(tell.in_current_span());
    }
}

/// Refuses (in the background) a join request from a peer proven to have lied.
fn refuse_banned(join: IncomingJoin, limit: Duration) {
    let mut stream = join.stream;
    tokio::spawn(async move {
        let reply = MatchMsg::Rejected(RejectReason::Banned);
        let _ = timeout(limit, write_control(&mut stream, &reply)).await;
    });
}

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
