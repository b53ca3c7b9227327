//! Matchmaking: forming a group through the DHT.
//!
//! States of one peer during one search window:
//! - **searching**: declared under the group key with `window_end`; looks up the key and asks
//!   the earliest-declared peer ahead of it (never a client, never one that refused for good) to
//!   take it. Requests only go to peers declared *earlier*, so requests never form a cycle and the
//!   earliest peer always ends up leading.
//! - **requesting / following**: a join request is in flight, or was accepted and the peer waits
//!   for the leader's `Begin` (until the leader's window end plus `request_timeout`). A refusal, a
//!   `Disband`, a timeout or a dead leader send it back to searching.
//! - **leading**: accepted at least one follower; it begins as soon as the group is full, or at
//!   its window end if the group has `min_group_size` members; otherwise it disbands and everyone
//!   searches again in a new window. While not full it keeps reading the key: if a peer declared
//!   earlier is searching (declarations reach peers at different times), it disbands and joins
//!   that peer, so groups merge towards the earliest peer instead of splitting.
//!
//! A leader accepts a follower only if it still ranks ahead of it under its *current*
//! declaration (a follower may have read an older one); otherwise it answers `Stale`.
//!
//! Incoming join requests are answered by the same task, so a peer is never both leading and
//! following.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use starling_dht::now_ms;
use starling_node::{PeerId, Stream};
use tokio::sync::mpsc;
use tokio::time::{sleep_until, timeout, timeout_at, Instant};

use crate::averager::Shared;
use crate::config::AveragingMode;
use crate::wire::{
    read_control, write_control, Declaration, MatchMsg, MemberInfo, RejectReason,
    MATCHMAKING_PROTOCOL,
};
use crate::AveragerError;

/// How often a searching peer re-reads the group key.
const REFRESH_INTERVAL: Duration = Duration::from_millis(200);
/// How long a peer that answered `Busy` is left alone.
const BUSY_BACKOFF: Duration = Duration::from_millis(150);
/// Queued join requests per search.
const JOIN_QUEUE: usize = 64;

/// A formed group.
#[derive(Debug, Clone)]
pub(crate) struct Group {
    pub round_id: u64,
    pub members: Vec<MemberInfo>,
    pub my_index: usize,
}

/// A join request routed to the search in progress.
pub(crate) struct IncomingJoin {
    pub info: MemberInfo,
    /// The follower's window end.
    pub window_end: u64,
    pub stream: Stream,
}

/// Removes the route of a search when it ends, however it ends.
struct RouteGuard<'a> {
    shared: &'a Shared,
    key: String,
}

impl Drop for RouteGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut routes) = self.shared.join_routes.lock() {
            routes.remove(&self.key);
        }
    }
}

enum FollowError {
    /// Try this leader again shortly.
    Busy,
    /// Do not ask this leader again in this search.
    Refused(String),
}

type FollowFuture = BoxFuture<'static, (Vec<u8>, Result<Option<Group>, FollowError>)>;

/// Searches until a group forms or `deadline` passes.
pub(crate) async fn find_group(
    shared: &Arc<Shared>,
    group_key: &str,
    me: MemberInfo,
    deadline: Instant,
) -> Result<Group, AveragerError> {
    let started = Instant::now();
    let (tx, mut rx) = mpsc::channel(JOIN_QUEUE);
    shared
        .join_routes
        .lock()
        .map_err(|_| AveragerError::Closed)?
        .insert(group_key.to_string(), tx);
    let _guard = RouteGuard {
        shared,
        key: group_key.to_string(),
    };
    let cfg = &shared.config;
    loop {
        let now = Instant::now();
        let window_end = (now + cfg.matchmaking_time).min(deadline);
        if window_end <= now + Duration::from_millis(50) {
            return Err(AveragerError::NoGroup {
                min: cfg.min_group_size,
                searched_ms: started.elapsed().as_millis() as u64,
            });
        }
        let window_end_ms = now_ms() + (window_end - now).as_millis() as u64;
        let declaration = Declaration {
            info: me.clone(),
            window_end: window_end_ms,
        };
        let subkey = shared.node.peer_id().to_string();
        if let Err(e) = timeout(
            cfg.request_timeout,
            shared
                .node
                .store(group_key, &subkey, &declaration, window_end_ms),
        )
        .await
        .unwrap_or(Err(starling_node::NodeError::Timeout("declare")))
        {
            tracing::debug!("declaring under {group_key}: {e}");
        }
        match run_window(shared, group_key, &me, window_end, window_end_ms, &mut rx).await? {
            Window::Group(group) => return Ok(group),
            Window::Again => {}
            // Nobody else searched under this key for a whole window: searching on until the
            // deadline would only hold the caller up (e.g. the odd peer out of a full grid key).
            Window::Alone => {
                return Err(AveragerError::NoGroup {
                    min: cfg.min_group_size,
                    searched_ms: started.elapsed().as_millis() as u64,
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

async fn run_window(
    shared: &Arc<Shared>,
    group_key: &str,
    me: &MemberInfo,
    window_end: Instant,
    window_end_ms: u64,
    rx: &mut mpsc::Receiver<IncomingJoin>,
) -> Result<Window, AveragerError> {
    let cfg = &shared.config;
    let my_rank = rank(window_end_ms, &me.peer_id);
    // Whether any other peer searched under the key during this window.
    let mut saw_others = false;
    let mut followers: Vec<IncomingJoin> = Vec::new();
    let mut refused: HashSet<Vec<u8>> = HashSet::new();
    let mut busy: HashMap<Vec<u8>, Instant> = HashMap::new();
    let mut attempt: Option<FollowFuture> = None;
    // Set once the leader of `attempt` accepted us: we are following, not just asking.
    let mut following = Arc::new(AtomicBool::new(false));
    let mut refresh = tokio::time::interval(REFRESH_INTERVAL);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = sleep_until(window_end), if attempt.is_none() => {
                tracing::trace!(me = %short(&me.peer_id), followers = followers.len(), "window closed");
                if !followers.is_empty() && followers.len() + 1 >= cfg.min_group_size {
                    return Ok(Window::Group(begin(shared, me, followers).await));
                }
                disband(&mut followers, cfg.request_timeout).await;
                if cfg.min_group_size <= 1 {
                    return Ok(Window::Group(begin(shared, me, Vec::new()).await));
                }
                return Ok(if saw_others { Window::Again } else { Window::Alone });
            }
            Some(mut join) = rx.recv() => {
                saw_others = true;
                let reply = if me.mode == AveragingMode::Client {
                    Some(RejectReason::NotLeading)
                } else if rank(join.window_end, &join.info.peer_id) <= my_rank {
                    Some(RejectReason::Stale)
                } else if attempt.is_some() && following.load(Ordering::Acquire) {
                    Some(RejectReason::NotLeading)
                } else if attempt.is_some() {
                    Some(RejectReason::Busy)
                } else if followers.len() + 1 >= cfg.target_group_size
                    || followers.iter().any(|f| f.info.peer_id == join.info.peer_id)
                {
                    Some(RejectReason::Full)
                } else {
                    None
                };
                let msg = match reply {
                    Some(r) => MatchMsg::Rejected(r),
                    None => MatchMsg::Accepted,
                };
                let sent = timeout(cfg.request_timeout, write_control(&mut join.stream, &msg)).await;
                tracing::trace!(me = %short(&me.peer_id), from = %short(&join.info.peer_id), ?reply, "join request");
                if reply.is_none() && matches!(sent, Ok(Ok(_))) {
                    followers.push(join);
                    if cfg.fault == Some(crate::config::Fault::LeaderAfterFollowers(followers.len())) {
                        shared.node.shutdown().await;
                        return Err(AveragerError::Closed);
                    }
                    if followers.len() + 1 >= cfg.target_group_size {
                        return Ok(Window::Group(begin(shared, me, followers).await));
                    }
                }
            }
            (leader, result) = async { attempt.as_mut().expect("guarded").await }, if attempt.is_some() => {
                attempt = None;
                match result {
                    Ok(Some(group)) => return Ok(Window::Group(group)),
                    Ok(None) => {
                        refused.insert(leader);
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
                refresh.reset_immediately();
            }
            // Also while leading a group that is not full: if an earlier peer is searching, this
            // group disbands and everyone joins that peer, so groups grow instead of splitting
            // when declarations reach peers at different times.
            _ = refresh.tick(), if attempt.is_none() && followers.len() + 1 < cfg.target_group_size => {
                let found = timeout(cfg.request_timeout, shared.node.get::<Declaration>(group_key)).await;
                let Ok(Ok(entries)) = found else { continue };
                saw_others |= entries.iter().any(|(_, d, _)| d.info.peer_id != me.peer_id);
                let now = Instant::now();
                let best = entries
                    .into_iter()
                    .map(|(_, d, _)| d)
                    .filter(|d| d.info.mode != AveragingMode::Client && d.info.peer_id != me.peer_id)
                    .filter(|d| rank(d.window_end, &d.info.peer_id) < my_rank)
                    .filter(|d| !refused.contains(&d.info.peer_id))
                    .filter(|d| busy.get(&d.info.peer_id).is_none_or(|t| *t <= now))
                    .min_by(|a, b| rank(a.window_end, &a.info.peer_id).cmp(&rank(b.window_end, &b.info.peer_id)));
                if let Some(leader) = best {
                    tracing::trace!(me = %short(&me.peer_id), leader = %short(&leader.info.peer_id), followers = followers.len(), "asking to join");
                    disband(&mut followers, cfg.request_timeout).await;
                    following = Arc::new(AtomicBool::new(false));
                    attempt = Some(follow(shared.clone(), group_key.to_string(), me.clone(), window_end_ms, leader, following.clone()).boxed());
                }
            }
        }
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
async fn begin(shared: &Arc<Shared>, me: &MemberInfo, mut followers: Vec<IncomingJoin>) -> Group {
    let round_id: u64 = rand::random();
    let mut members = vec![me.clone()];
    members.extend(followers.iter().map(|f| f.info.clone()));
    let msg = MatchMsg::Begin {
        round_id,
        members: members.clone(),
    };
    let timeout_each = shared.config.request_timeout;
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
    Group {
        round_id,
        members,
        my_index: 0,
    }
}

async fn follow(
    shared: Arc<Shared>,
    group_key: String,
    me: MemberInfo,
    my_window_end: u64,
    leader: Declaration,
    accepted: Arc<AtomicBool>,
) -> (Vec<u8>, Result<Option<Group>, FollowError>) {
    let id = leader.info.peer_id.clone();
    let result = follow_inner(&shared, group_key, me, my_window_end, leader, accepted).await;
    (id, result)
}

async fn follow_inner(
    shared: &Shared,
    group_key: String,
    me: MemberInfo,
    my_window_end: u64,
    leader: Declaration,
    accepted: Arc<AtomicBool>,
) -> Result<Option<Group>, FollowError> {
    let cfg = &shared.config;
    let refused = |e: &dyn std::fmt::Display| FollowError::Refused(e.to_string());
    let peer = PeerId::from_bytes(&leader.info.peer_id).map_err(|e| refused(&e))?;
    let mut stream = shared
        .open_stream(peer, &leader.info.addrs, MATCHMAKING_PROTOCOL)
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
    let reply: MatchMsg = timeout(
        cfg.request_timeout,
        read_control(&mut stream, cfg.max_frame_bytes),
    )
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
    let wait_ms = leader.window_end.saturating_sub(now_ms());
    let until = Instant::now() + Duration::from_millis(wait_ms) + cfg.request_timeout;
    let decision: MatchMsg = timeout_at(until, read_control(&mut stream, cfg.max_frame_bytes))
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
            Ok(Some(Group {
                round_id,
                members,
                my_index,
            }))
        }
        MatchMsg::Disband => Ok(None),
        other => Err(FollowError::Refused(format!("unexpected {other:?}"))),
    }
}
