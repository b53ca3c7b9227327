//! Matchmaking: forming a group through the DHT (the protocol is explained in the crate docs,
//! "Matchmaking"). One search runs per step; its join requests arrive through the
//! [`Router`](crate::router::Router) and leave through the [`Transport`].

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use starling_dht::now_ms;
use starling_node::{NodeError, PeerId};
use tokio::sync::mpsc;
use tokio::time::{sleep_until, timeout, timeout_at, Instant};
use tracing::Instrument;

use crate::config::{AveragerConfig, AveragingMode, Fault};
use crate::group::{Group, Member};
use crate::router::{IncomingJoin, Router};
use crate::transport::Transport;
use crate::wire::{
    read_control, write_control, Declaration, MatchMsg, MemberInfo, RejectReason,
    MATCHMAKING_PROTOCOL,
};
use crate::AveragerError;

/// How often a searching peer re-reads the group key.
const REFRESH_INTERVAL: Duration = Duration::from_millis(200);
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
}

/// Why asking a leader to take us did not end in a group.
enum FollowError {
    /// Try this leader again shortly.
    Busy,
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
        let declaration = Declaration {
            info: me.clone(),
            window_end: window_end_ms,
        };
        // Under our owner marker: signed by the node, so nobody else can overwrite it. The DHT
        // keeps the entry that expires last, so this one must outlive every entry this peer
        // wrote before under the key, closed ones included (a window cut short by the deadline
        // can end before the last one did); readers go by `window_end`, not by the expiration.
        let subkey = node.owner_marker();
        let expiration = window_end_ms.max(mm.declared_until.load(Ordering::Acquire) + 1);
        mm.declared_until.fetch_max(expiration, Ordering::AcqRel);
        match timeout(
            cfg.request_timeout,
            node.store(group_key, &subkey, &declaration, expiration),
        )
        .await
        .unwrap_or(Err(NodeError::Timeout("declare")))
        {
            Ok(_) => {}
            Err(NodeError::Closed) => return Err(NodeError::Closed.into()),
            Err(e) => tracing::debug!("declaring under {group_key}: {e}"),
        }
        match run_window(mm, group_key, &me, window_end, window_end_ms, &mut rx).await? {
            Window::Group(group) => {
                let closed_until = mm.declared_until.fetch_add(1, Ordering::AcqRel) + 1;
                close_declaration(
                    node,
                    group_key,
                    &subkey,
                    &me,
                    closed_until,
                    cfg.request_timeout,
                );
                return Ok(group);
            }
            Window::Again => {}
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

/// How a search window ended.
enum Window {
    /// In a group.
    Group(Group),
    /// Others searched too but no group formed: search again.
    Again,
    /// No other peer searched under the key during the whole window.
    Alone,
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

fn rank(window_end: u64, peer: &[u8]) -> (u64, Vec<u8>) {
    (window_end, peer.to_vec())
}

/// One search window: the state machine of the crate docs' "Matchmaking" section, one
/// `select!` arm per event (window end, join request, answer of the leader asked, refresh of
/// the group key). Long because the states share their locals; splitting it would pass them all
/// around.
async fn run_window(
    mm: &Matchmaker,
    group_key: &str,
    me: &MemberInfo,
    window_end: Instant,
    window_end_ms: u64,
    rx: &mut mpsc::Receiver<IncomingJoin>,
) -> Result<Window, AveragerError> {
    let cfg = &mm.config;
    let node = mm.transport.node();
    let my_rank = rank(window_end_ms, &me.peer_id);
    // Whether another peer searches under the key: as of the last read, or asked to join since.
    let mut saw_others = false;
    let mut followers: Vec<IncomingJoin> = Vec::new();
    let mut refused: HashSet<Vec<u8>> = HashSet::new();
    let mut busy: HashMap<Vec<u8>, Instant> = HashMap::new();
    let mut attempt: Option<FollowFuture> = None;
    // The last read of the key, while fresh: a refused or busy leader's successor is taken from
    // it rather than from a new lookup (a join request is one stream; a lookup asks a score of
    // peers, and 64 peers stepping through refusals at once made the lookups the bottleneck).
    let mut last_read: Option<(Instant, Vec<Declaration>)> = None;
    // Set once the leader of `attempt` accepted us: we are following, not just asking.
    let mut following = Arc::new(AtomicBool::new(false));
    let opened = Instant::now();
    let mut refresh = tokio::time::interval(REFRESH_INTERVAL);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = sleep_until(window_end), if attempt.is_none() => {
                return close_window(cfg, me, followers, saw_others).await;
            }
            Some(mut join) = rx.recv() => {
                saw_others = true;
                let asking = match (&attempt, following.load(Ordering::Acquire)) {
                    (None, _) => Asking::Nobody,
                    (Some(_), false) => Asking::Requesting,
                    (Some(_), true) => Asking::Following,
                };
                let accepted: Vec<&MemberInfo> = followers.iter().map(|f| &f.info).collect();
                let reply = join_reply(cfg.target_group_size, me, my_rank.clone(), (&join.info, join.window_end), asking, &accepted);
                let msg = match reply {
                    Some(r) => MatchMsg::Rejected(r),
                    None => MatchMsg::Accepted,
                };
                let sent = timeout(cfg.request_timeout, write_control(&mut join.stream, &msg)).await;
                tracing::trace!(me = %short(&me.peer_id), from = %short(&join.info.peer_id), ?reply, "join request");
                if reply.is_none() && matches!(sent, Ok(Ok(_))) {
                    followers.push(join);
                    if cfg.fault() == Some(Fault::LeaderAfterFollowers(followers.len())) {
                        node.shutdown().await;
                        return Err(NodeError::Closed.into());
                    }
                    if followers.len() + 1 >= cfg.target_group_size {
                        return Ok(Window::Group(begin(cfg, me, followers).await?));
                    }
                    // Perhaps everyone searching has joined now: read the declarations at once
                    // rather than at the next refresh (the read decides; see below).
                    if followers.len() + 1 >= cfg.min_group_size {
                        refresh.reset_immediately();
                    }
                }
            }
            (leader, result) = async { attempt.as_mut().expect("guarded").await }, if attempt.is_some() => {
                attempt = None;
                match result {
                    Ok(Some(group)) => return Ok(Window::Group(group)),
                    // Disbanded: a leader that disbands to join an earlier peer, whose join
                    // then fails, leads again; refusing it for the rest of the window left its
                    // ex-followers and it unable to find each other (requests only go to
                    // earlier peers). Ask again after a short pause instead.
                    Ok(None) => {
                        busy.insert(leader, Instant::now() + BUSY_BACKOFF);
                    }
                    Err(FollowError::Busy) => {
                        busy.insert(leader, Instant::now() + BUSY_BACKOFF);
                    }
                    Err(FollowError::Refused(why)) => {
                        tracing::trace!(me = %short(&me.peer_id), "join refused: {why}");
                        refused.insert(leader);
                    }
                }
                // Try the next candidate now rather than at the next refresh: a refusal is often
                // a declaration left over from the previous round by a peer not searching yet.
                // From the last read while it is fresh, else from a new one.
                let now = Instant::now();
                let next = last_read
                    .as_ref()
                    .filter(|(at, _)| now.duration_since(*at) < REFRESH_INTERVAL)
                    .and_then(|(_, entries)| pick_leader(entries, me, &my_rank, &refused, &busy, now));
                // (No followers to disband: they were when this attempt began, and joins are
                // refused while it runs.)
                match next {
                    Some(leader) => {
                        tracing::trace!(me = %short(&me.peer_id), leader = %short(&leader.info.peer_id), "asking the next leader of the last read");
                        (following, attempt) = ask(mm, group_key, me, window_end_ms, leader);
                    }
                    None => refresh.reset_immediately(),
                }
            }
            // Also while leading a group that is not full: if an earlier peer is searching, this
            // group disbands and everyone joins that peer, so groups grow instead of splitting
            // when declarations reach peers at different times.
            _ = refresh.tick(), if attempt.is_none() && followers.len() + 1 < cfg.target_group_size => {
                let Some(entries) = read_declarations(node, group_key, cfg.request_timeout).await? else {
                    continue;
                };
                // Whether others search now: peers that found a group meanwhile closed their
                // declarations, and a peer left out by all of them is alone, not "again".
                saw_others = entries.iter().any(|d| d.info.peer_id != me.peer_id);
                let declared: Vec<Vec<u8>> = entries
                    .iter()
                    .filter(|d| d.info.peer_id != me.peer_id)
                    .map(|d| d.info.peer_id.clone())
                    .collect();
                let now = Instant::now();
                let best = pick_leader(&entries, me, &my_rank, &refused, &busy, now);
                last_read = Some((now, entries));
                if let Some(leader) = best {
                    tracing::trace!(me = %short(&me.peer_id), leader = %short(&leader.info.peer_id), followers = followers.len(), "asking to join");
                    disband(&mut followers, cfg.request_timeout).await;
                    (following, attempt) = ask(mm, group_key, me, window_end_ms, leader);
                } else if me.mode != AveragingMode::Client
                    && everyone_joined(&declared, followers.iter().map(|f| f.info.peer_id.as_slice()), cfg.min_group_size)
                    && (opened.elapsed() >= early_start_grace(cfg)
                        || last_group_here(node, missing_from_last_group(&mm.previous, &followers)).await)
                {
                    // Nobody declared under the key is missing: the rest of the window could
                    // only wait for latecomers or for peers that left (their declarations
                    // expire with their windows), so the group starts now.
                    tracing::debug!(me = %short(&me.peer_id), followers = followers.len(), "every declared peer joined: beginning");
                    return Ok(Window::Group(begin(cfg, me, followers).await?));
                }
            }
        }
    }
}

/// The leader to ask among `entries` (live declarations under the key): the earliest-ranked
/// non-client other than us that we have not been refused by, is not backing off from, and
/// ranks ahead of us (so requests never form a cycle; a client never leads, so it asks the
/// earliest leader whatever its own rank).
fn pick_leader(
    entries: &[Declaration],
    me: &MemberInfo,
    my_rank: &(u64, Vec<u8>),
    refused: &HashSet<Vec<u8>>,
    busy: &HashMap<Vec<u8>, Instant>,
    now: Instant,
) -> Option<Declaration> {
    entries
        .iter()
        .filter(|d| d.info.mode != AveragingMode::Client && d.info.peer_id != me.peer_id)
        .filter(|d| Member::parse(&d.info).is_ok())
        .filter(|d| {
            me.mode == AveragingMode::Client || rank(d.window_end, &d.info.peer_id) < *my_rank
        })
        .filter(|d| !refused.contains(&d.info.peer_id))
        .filter(|d| busy.get(&d.info.peer_id).is_none_or(|t| *t <= now))
        .min_by(|a, b| {
            rank(a.window_end, &a.info.peer_id).cmp(&rank(b.window_end, &b.info.peer_id))
        })
        .cloned()
}

/// How long a leader's window must have been open before it begins with every declared peer
/// and fewer than `target_group_size`: peers reaching the same step within moments of each
/// other have declared by then (by default a tenth of the window, at most half a second; see
/// `AveragerConfig::start_grace`), so a group does not start without a peer that was only a few
/// milliseconds late; a peer that left costs this much instead of the whole window.
fn early_start_grace(cfg: &AveragerConfig) -> Duration {
    cfg.effective_start_grace()
}

/// Whether every member of this peer's previous group either joined or is gone (no connection
/// to it): then nobody the grace would wait for is merely late. A stable group, or one that
/// lost a member whose connection closed, begins at once; a previous member still connected
/// but not yet searching is waited for (the grace). `missing`: see [`missing_from_last_group`].
async fn last_group_here(node: &starling_node::Node, missing: Option<Vec<PeerId>>) -> bool {
    let Some(missing) = missing else {
        return false;
    };
    if missing.is_empty() {
        return true;
    }
    match node.connected_peers().await {
        Ok(connected) => missing.iter().all(|p| !connected.contains(p)),
        Err(_) => false,
    }
}

/// The members of the previous group (`None` before the first) that have not joined.
fn missing_from_last_group(previous: &[PeerId], followers: &[IncomingJoin]) -> Option<Vec<PeerId>> {
    if previous.is_empty() {
        return None;
    }
    Some(
        previous
            .iter()
            .filter(|p| {
                let id = p.to_bytes();
                !followers.iter().any(|f| f.info.peer_id == id)
            })
            .copied()
            .collect(),
    )
}

/// Whether a leader whose followers are `followers` has every other peer `declared` under its
/// key among them, and enough of them (at least one, and `min_group_size` with itself).
fn everyone_joined<'a>(
    declared: &[Vec<u8>],
    followers: impl Iterator<Item = &'a [u8]> + Clone,
    min_group_size: usize,
) -> bool {
    let joined = followers.clone().count();
    joined > 0
        && joined + 1 >= min_group_size
        && declared
            .iter()
            .all(|p| followers.clone().any(|f| f == p.as_slice()))
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

/// The window ended with nobody to follow: begin with the followers if they are enough, else
/// disband them and say whether anyone else was seen.
async fn close_window(
    cfg: &AveragerConfig,
    me: &MemberInfo,
    mut followers: Vec<IncomingJoin>,
    saw_others: bool,
) -> Result<Window, AveragerError> {
    tracing::trace!(me = %short(&me.peer_id), followers = followers.len(), "window closed");
    if !followers.is_empty() && followers.len() + 1 >= cfg.min_group_size {
        return Ok(Window::Group(begin(cfg, me, followers).await?));
    }
    disband(&mut followers, cfg.request_timeout).await;
    if cfg.min_group_size <= 1 {
        return Ok(Window::Group(begin(cfg, me, Vec::new()).await?));
    }
    Ok(if saw_others {
        Window::Again
    } else {
        Window::Alone
    })
}

/// Where this peer stands with the leader it asked, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asking {
    Nobody,
    /// A join request is in flight.
    Requesting,
    /// The leader accepted us; we wait for its `Begin`.
    Following,
}

/// How a searching peer answers a join request: `None` accepts it. Invalid requests, requests
/// to a client (which never leads), from a non-client that ranks ahead of us (it read an old
/// declaration), while we ask or follow someone, and past the target size are refused.
/// `followers` are those accepted so far, `window_end` the joiner's.
fn join_reply(
    target_group_size: usize,
    me: &MemberInfo,
    my_rank: (u64, Vec<u8>),
    (info, window_end): (&MemberInfo, u64),
    asking: Asking,
    followers: &[&MemberInfo],
) -> Option<RejectReason> {
    if let Err(why) = Member::parse(info) {
        tracing::debug!(from = %short(&info.peer_id), "refused an invalid join request: {why}");
        return Some(RejectReason::Invalid);
    }
    let ahead_of_us = rank(window_end, &info.peer_id) <= my_rank;
    if me.mode == AveragingMode::Client {
        Some(RejectReason::NotLeading)
    } else if info.mode != AveragingMode::Client && ahead_of_us {
        // (A client never leads, so it may join whatever its rank.)
        Some(RejectReason::Stale)
    } else if asking == Asking::Following {
        Some(RejectReason::NotLeading)
    } else if asking == Asking::Requesting {
        Some(RejectReason::Busy)
    } else if followers.len() + 1 >= target_group_size
        || followers.iter().any(|f| f.peer_id == info.peer_id)
    {
        Some(RejectReason::Full)
    } else {
        None
    }
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

/// The leader's move: fix the member list, tell every follower, and return the group.
async fn begin(
    cfg: &AveragerConfig,
    me: &MemberInfo,
    mut followers: Vec<IncomingJoin>,
) -> Result<Group, AveragerError> {
    let round_id: u64 = rand::random();
    let mut members = vec![me.clone()];
    members.extend(followers.iter().map(|f| f.info.clone()));
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
    let leader_member = Member::parse(&leader.info).map_err(|e| refused(&e))?;
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
    // A stream that fails before any answer was most likely dropped by libp2p-stream's accept
    // queue under a burst of requests: ask again shortly rather than giving up on this leader.
    // (A leader that is really gone stops being a candidate when its declaration expires.)
    timeout(cfg.request_timeout, write_control(&mut stream, &join))
        .await
        .map_err(|e| refused(&e))?
        .map_err(|_| FollowError::Busy)?;
    let reply: MatchMsg = timeout(cfg.request_timeout, read_control(&mut stream))
        .await
        .map_err(|e| refused(&e))?
        .map_err(|_| FollowError::Busy)?;
    match reply {
        MatchMsg::Accepted => accepted.store(true, Ordering::Release),
        MatchMsg::Rejected(RejectReason::Busy | RejectReason::Stale) => {
            return Err(FollowError::Busy)
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
            // Peer ids are parsed once, here: a malformed one refuses the group.
            Group::new(round_id, &members, my_index)
                .map(Some)
                .map_err(|e| FollowError::Refused(format!("malformed begin message: {e}")))
        }
        MatchMsg::Disband => Ok(None),
        other => Err(FollowError::Refused(format!("unexpected {other:?}"))),
    }
}

#[cfg(test)]
mod tests;
