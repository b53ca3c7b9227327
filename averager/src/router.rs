//! Inbound averaging streams and where they go: join requests to the search in progress under
//! their group key, reduce streams (libp2p streams and fast lanes) to the round their hello
//! names. A search or round registers its queues with the [`Router`] and holds the returned
//! [`Registration`] for as long as it wants traffic; dropping it unregisters.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use starling_node::streams::{serve_inbound, InboundLimits};
use starling_node::{FastStream, Node, PeerId, Stream};
use tokio::sync::{mpsc, Notify};
use tokio::task::{AbortHandle, JoinHandle};
use tokio::time::{timeout, Instant};
use tracing::Instrument;

use crate::transport::{young, Lane, LANE_IDLE_IN};
use crate::verify::{Evidence, Transcripts};
use crate::wire::{
    read_control, write_control, Control, MatchMsg, MemberInfo, ReduceMsg, RejectReason,
    MATCHMAKING_PROTOCOL, MAX_CONTROL_BYTES, REDUCE_PROTOCOL, UNKNOWN_ROUND,
};
use crate::AveragerError;
use starling_node::lock::lock;

/// Inbound streams whose first message is being read at once, per protocol (bounds tasks and
/// buffers).
pub(crate) const MAX_INBOUND_HANDSHAKES: usize = 256;
/// Queued join requests per search.
const JOIN_QUEUE: usize = 64;
/// Repair hellos queued per member of the group (a member sends at most one per failed span).
const REPAIR_QUEUE_PER_MEMBER: usize = 4;
/// Reducer ends of idle lanes waiting for their next hello, at most.
const MAX_PARKED: usize = 256;
/// Declined rounds remembered (see [`Router::decline`]).
const DECLINED_KEPT: usize = 64;

/// A join request routed to the search in progress.
pub(crate) struct IncomingJoin {
    pub info: MemberInfo,
    /// The follower's window end (unix ms).
    pub window_end: u64,
    pub stream: Stream,
}

/// A sender's stream routed to the round it names.
pub(crate) struct IncomingSender {
    pub peer: PeerId,
    pub hello: ReduceMsg,
    pub stream: Lane,
}

/// Another member's verdict on a verified round (see [`ReduceMsg::Verdict`]).
pub(crate) struct IncomingVerdict {
    pub peer: PeerId,
    pub evidence: Option<Box<Evidence>>,
}

/// A round's inbound queues: plain hellos (the reduction of this peer's own span), repair
/// hellos (its re-delegation phase) and the other members' verdicts (verified rounds).
pub(crate) struct RoundQueues {
    pub senders: mpsc::Receiver<IncomingSender>,
    pub repairs: mpsc::Receiver<IncomingSender>,
    pub verdicts: mpsc::Receiver<IncomingVerdict>,
}

struct RoundRoute {
    senders: mpsc::Sender<IncomingSender>,
    repairs: mpsc::Sender<IncomingSender>,
    verdicts: mpsc::Sender<IncomingVerdict>,
}

/// Where an inbound reduce stream goes within its round.
enum RoundQueue {
    Senders,
    Repairs,
    Verdicts,
}

#[derive(Default)]
struct Routes {
    searches: HashMap<String, mpsc::Sender<IncomingJoin>>,
    rounds: HashMap<u64, RoundRoute>,
    /// Rounds this peer was listed in and refused (newest last, at most [`DECLINED_KEPT`]):
    /// their hellos are answered at once instead of waited on for a registration that will
    /// not come.
    declined: std::collections::VecDeque<u64>,
}

/// Routes inbound averaging streams (cheap to clone).
#[derive(Clone)]
pub(crate) struct Router {
    routes: Arc<Mutex<Routes>>,
    request_timeout: Duration,
    /// Tasks holding the reducer ends of idle lanes (see [`Router::park`]).
    parked: Arc<Mutex<Vec<AbortHandle>>>,
    /// Wakes reduce streams waiting for their round (the reducer may learn of the round a
    /// little after the sender) when a round registers.
    registered: Arc<Notify>,
    /// This peer's latest round transcripts, for reveals (see [`crate::verify`]).
    transcripts: Transcripts,
}

/// What a [`Registration`] keeps registered.
enum Key {
    Search(String),
    Round(u64),
}

/// Keeps a search's or a round's queues registered while it lives.
pub(crate) struct Registration {
    routes: Arc<Mutex<Routes>>,
    key: Key,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut routes = lock(&self.routes);
        match &self.key {
            Key::Search(k) => {
                routes.searches.remove(k);
            }
            Key::Round(id) => {
                routes.rounds.remove(id);
            }
        }
    }
}

impl Router {
    pub fn new(request_timeout: Duration) -> Self {
        Router {
            routes: Arc::default(),
            request_timeout,
            parked: Arc::default(),
            registered: Arc::default(),
            transcripts: Transcripts::default(),
        }
    }

    /// Where this peer's rounds keep their transcripts for reveals.
    pub fn transcripts(&self) -> Transcripts {
        self.transcripts.clone()
    }

    /// Keeps the reducer's end of a lane whose exchange ended cleanly: the next hello that
    /// `peer` sends on it (within [`LANE_IDLE_IN`]) is routed like one on a new lane; a lane
    /// that stays quiet, breaks, or finds [`MAX_PARKED`] lanes already waiting is dropped.
    pub fn park(&self, peer: PeerId, mut lane: FastStream) {
        let mut parked = lock(&self.parked);
        parked.retain(|h| !h.is_finished());
        // Only worn or old lanes are refused here: the sender's next hello may already have
        // arrived (it is read below), so "quiet" is not asked for.
        if parked.len() >= MAX_PARKED || !young(&lane) {
            return;
        }
        let router = self.clone();
        let task = async move {
            let hello = timeout(LANE_IDLE_IN, read_control::<_, ReduceMsg>(&mut lane)).await;
            match hello {
                Ok(Ok(hello)) => {
                    router
                        .on_reduce(peer, hello, Lane::Fast(Box::new(lane)))
                        .await
                }
                Ok(Err(e)) => tracing::trace!(%peer, "idle lane ended: {e}"),
                Err(_) => tracing::trace!(%peer, "idle lane expired"),
            }
        };
        parked.push(tokio::spawn(task.in_current_span()).abort_handle());
    }

    /// Remembers that this peer refused round `round_id` (listed in its group, it will never
    /// register it): streams for it are answered at once as for an unknown round, so that its
    /// members re-delegate this peer's span now rather than after a request timeout.
    pub fn decline(&self, round_id: u64) {
        let mut routes = lock(&self.routes);
        if routes.declined.len() >= DECLINED_KEPT {
            routes.declined.pop_front();
        }
        routes.declined.push_back(round_id);
        drop(routes);
        self.registered.notify_waiters();
    }

    /// Drops every parked lane (the averager is shutting down).
    pub fn stop_parked(&self) {
        for h in lock(&self.parked).drain(..) {
            h.abort();
        }
    }

    /// Routes join requests under `group_key` to the returned queue until the registration
    /// drops.
    pub fn register_search(&self, group_key: &str) -> (Registration, mpsc::Receiver<IncomingJoin>) {
        let (tx, rx) = mpsc::channel(JOIN_QUEUE);
        lock(&self.routes)
            .searches
            .insert(group_key.to_string(), tx);
        let reg = Registration {
            routes: self.routes.clone(),
            key: Key::Search(group_key.to_string()),
        };
        (reg, rx)
    }

    /// Routes reduce streams of round `round_id` (a group of `members`) to the returned queues
    /// until the registration drops.
    pub fn register_round(&self, round_id: u64, members: usize) -> (Registration, RoundQueues) {
        let (tx, senders) = mpsc::channel(members + 4);
        let (repair_tx, repairs) = mpsc::channel(REPAIR_QUEUE_PER_MEMBER * members + 4);
        // One verdict per other member; a member that sends more loses the extra ones.
        let (verdict_tx, verdicts) = mpsc::channel(members + 4);
        lock(&self.routes).rounds.insert(
            round_id,
            RoundRoute {
                senders: tx,
                repairs: repair_tx,
                verdicts: verdict_tx,
            },
        );
        self.registered.notify_waiters();
        let reg = Registration {
            routes: self.routes.clone(),
            key: Key::Round(round_id),
        };
        let queues = RoundQueues {
            senders,
            repairs,
            verdicts,
        };
        (reg, queues)
    }

    /// Starts the accept loops of both averaging protocols on `node` (libp2p streams, and fast
    /// lanes when `fast_lane` is set and the node listens for them), each in the current span.
    /// Fails if another averager already serves the node.
    pub fn serve(
        &self,
        node: &Node,
        fast_lane: bool,
    ) -> Result<Vec<JoinHandle<()>>, AveragerError> {
        let mut control = node.stream_control();
        let joins = control
            .accept(MATCHMAKING_PROTOCOL)
            .map_err(|_| AveragerError::AlreadyRunning)?;
        let reduces = control
            .accept(REDUCE_PROTOCOL)
            .map_err(|_| AveragerError::AlreadyRunning)?;
        let limits = InboundLimits {
            max_pending: MAX_INBOUND_HANDSHAKES,
            first_message_timeout: self.request_timeout,
            max_first_message: MAX_CONTROL_BYTES + 1,
        };
        let on_join = {
            let router = self.clone();
            move |peer, Control::Control(msg), stream| {
                let router = router.clone();
                async move { router.on_join(peer, msg, stream).await }
            }
        };
        let on_reduce = {
            let router = self.clone();
            move |peer, Control::Control(msg), stream| {
                let router = router.clone();
                async move { router.on_reduce(peer, msg, stream).await }
            }
        };
        let mut tasks = vec![tokio::spawn(
            serve_inbound(joins, limits, on_join.clone()).in_current_span(),
        )];
        tasks.extend(serve_lanes(
            node,
            reduces,
            REDUCE_PROTOCOL,
            fast_lane,
            limits,
            on_reduce,
        )?);
        Ok(tasks)
    }

    /// Routes a join request to the search in progress under its group key, or refuses it.
    async fn on_join(&self, peer: PeerId, msg: MatchMsg, mut stream: Stream) {
        let MatchMsg::Join {
            group_key,
            info,
            window_end,
        } = msg
        else {
            return;
        };
        if info.peer_id != peer.to_bytes() {
            tracing::debug!(%peer, "join request names another peer");
            return;
        }
        let route = lock(&self.routes).searches.get(&group_key).cloned();
        let refusal = match route {
            Some(tx) => match tx.try_send(IncomingJoin {
                info,
                window_end,
                stream,
            }) {
                Ok(()) => return,
                Err(mpsc::error::TrySendError::Full(j) | mpsc::error::TrySendError::Closed(j)) => {
                    stream = j.stream;
                    RejectReason::Busy
                }
            },
            None => RejectReason::NotSearching,
        };
        let reply = MatchMsg::Rejected(refusal);
        let _ = timeout(self.request_timeout, write_control(&mut stream, &reply)).await;
    }

    /// Routes a sender's stream to the round its hello names (a re-delegation hello to the
    /// round's repair queue, a verdict to its verdicts), waiting a little for a round that this
    /// peer has not started yet.
    async fn on_reduce(&self, peer: PeerId, hello: ReduceMsg, mut stream: Lane) {
        let (round_id, queue) = match hello {
            ReduceMsg::Hello { round_id, .. } => (round_id, RoundQueue::Senders),
            ReduceMsg::RepairHello { round_id, .. } => (round_id, RoundQueue::Repairs),
            ReduceMsg::Verdict { round_id, .. } => (round_id, RoundQueue::Verdicts),
            // Another member leaves the round: the reduction of this peer's span stops
            // waiting for its part.
            ReduceMsg::Declined { round_id, .. } => (round_id, RoundQueue::Senders),
            ReduceMsg::Reveal {
                round_id,
                start,
                len,
                block,
            } => {
                return self
                    .on_reveal(peer, round_id, (start, len, block), stream)
                    .await
            }
            _ => return,
        };
        let give_up = Instant::now() + self.request_timeout;
        let route = loop {
            // Listen for registrations before looking, so none is missed in between.
            let registered = self.registered.notified();
            tokio::pin!(registered);
            registered.as_mut().enable();
            let (found, declined) = {
                let routes = lock(&self.routes);
                let found = routes.rounds.get(&round_id).map(|route| match queue {
                    RoundQueue::Senders => Ok(route.senders.clone()),
                    RoundQueue::Repairs => Ok(route.repairs.clone()),
                    RoundQueue::Verdicts => Err(route.verdicts.clone()),
                });
                (found, routes.declined.contains(&round_id))
            };
            if found.is_some() || declined || Instant::now() >= give_up {
                break found;
            }
            let _ = tokio::time::timeout_at(give_up, registered).await;
        };
        let route = match route {
            Some(Err(verdicts)) => {
                // Queued if there is room (one per member; more are dropped), and answered
                // `Ready` either way, so that the member does not send it again.
                if let ReduceMsg::Verdict { evidence, .. } = hello {
                    let _ = verdicts.try_send(IncomingVerdict { peer, evidence });
                }
                self.answer(peer, stream, &ReduceMsg::Ready).await;
                return;
            }
            Some(Ok(tx)) => Some(tx),
            None => None,
        };
        if let Some(tx) = route {
            let incoming = IncomingSender {
                peer,
                hello,
                stream,
            };
            match tx.send(incoming).await {
                Ok(()) => return,
                // The round's reduction is over (the round lingers only to serve repairs): to
                // this sender, as good as a reducer that is gone.
                Err(mpsc::error::SendError(incoming)) => stream = incoming.stream,
            }
        }
        let reply = ReduceMsg::Excluded(UNKNOWN_ROUND.into());
        let _ = timeout(self.request_timeout, write_control(&mut stream, &reply)).await;
    }
}

impl Router {
    /// Answers a verifier's request for a block of this peer's result in a recent round
    /// (`what`: the part's absolute start, its length, the block).
    async fn on_reveal(&self, peer: PeerId, round_id: u64, what: (u64, u64, u32), stream: Lane) {
        let (start, len, block) = what;
        let until = Instant::now() + self.request_timeout;
        let shown = match (usize::try_from(start), usize::try_from(len)) {
            (Ok(start), Ok(len)) => match self.transcripts.wait_for(round_id, start, until).await {
                Some(t) => t.reveal(start, len, block as usize),
                None => Err("no such round among the recent ones".into()),
            },
            _ => Err("no such block".into()),
        };
        let reply = match shown {
            Ok(r) => ReduceMsg::Revealed(Box::new(r)),
            Err(why) => {
                tracing::debug!(%peer, "could not reveal a block: {why}");
                ReduceMsg::Excluded(why)
            }
        };
        self.answer(peer, stream, &reply).await;
    }

    /// Writes the one-message answer to a verdict or a reveal request. A fast lane (a warm one
    /// from the round's exchange, most often) is parked again for the next round; a libp2p
    /// stream is closed.
    async fn answer(&self, peer: PeerId, mut stream: Lane, reply: &ReduceMsg) {
        let written = timeout(self.request_timeout, async {
            write_control(&mut stream, reply).await?;
            futures::AsyncWriteExt::flush(&mut stream).await?;
            if !stream.is_fast() {
                futures::AsyncWriteExt::close(&mut stream).await?;
            }
            Ok::<_, AveragerError>(())
        })
        .await;
        if let (Ok(Ok(())), Lane::Fast(lane)) = (written, stream) {
            self.park(peer, *lane);
        }
    }
}

/// Serves `protocol` on libp2p streams (`streams`, already accepted) and, when `fast_lane` is
/// set and the node listens for lanes, on fast lanes too: each stream's first control message is
/// read under `limits`, then message and stream (as a [`Lane`]) go to `handle` on a task of
/// their own. Returns the accept loops' tasks (abort them to stop serving). Shared by the
/// all-reduce's reduce streams and gossip exchanges.
pub(crate) fn serve_lanes<M, F, Fut>(
    node: &Node,
    streams: starling_node::IncomingStreams,
    protocol: starling_node::StreamProtocol,
    fast_lane: bool,
    limits: InboundLimits,
    handle: F,
) -> Result<Vec<JoinHandle<()>>, AveragerError>
where
    M: serde::de::DeserializeOwned + Send + 'static,
    F: Fn(PeerId, Control<M>, Lane) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let streams = streams.map(|(peer, s)| (peer, Lane::P2p(s)));
    let mut tasks = vec![tokio::spawn(
        serve_inbound(streams, limits, handle.clone()).in_current_span(),
    )];
    // Peers reach this one over its fast lane when it has one (never in client mode).
    if fast_lane && node.fast_lane_port().is_some() {
        let mut lanes = node
            .accept_fast(protocol)
            .map_err(|_| AveragerError::AlreadyRunning)?;
        let lanes = futures::stream::poll_fn(move |cx| lanes.poll_recv(cx))
            .map(|(peer, s)| (peer, Lane::Fast(Box::new(s))));
        tasks.push(tokio::spawn(
            serve_inbound(lanes, limits, handle).in_current_span(),
        ));
    }
    Ok(tasks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_unregister_when_dropped() {
        let router = Router::new(Duration::from_secs(1));
        let (a, _rx) = router.register_search("k");
        let (b, _q) = router.register_round(7, 4);
        assert!(lock(&router.routes).searches.contains_key("k"));
        assert!(lock(&router.routes).rounds.contains_key(&7));
        drop(a);
        assert!(!lock(&router.routes).searches.contains_key("k"));
        drop(b);
        assert!(lock(&router.routes).rounds.is_empty());
    }
}
