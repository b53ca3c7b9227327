//! Kademlia queries in flight and the Kademlia events that answer them.
//!
//! The swarm task starts a query on `kad::Behaviour` and parks the caller's reply here, keyed by
//! the query id; Kademlia events then fill in and finish it. A GET for the latest value merges
//! every record found (after validation) into one dictionary, answers once the query's last
//! step arrives or, when it already holds a live entry (the local store's counts), once its
//! budget (a quarter of the request timeout) is spent, and writes the merged record back to
//! the closest peer that lacked it (a cache, so the next lookup stops sooner); so a peer among
//! the closest that died and whose dial hangs delays a read by the budget instead of the whole
//! query timeout. The closest peers a PUT's lookup found are kept for [`CLOSEST_TTL`]: a
//! node that writes the same key again soon (a training peer's progress, its state
//! announcement, a matchmaking declaration and its closing: several times a second) writes
//! straight to them, without a lookup; if that write misses its quorum, it is made again
//! with a fresh lookup. A GET for the first value answers, and ends the query, at the first valid
//! record with a live entry. A PUT runs in two steps: a lookup of the
//! closest peers, cut short at its budget (half the request timeout) with the closest that
//! answered by then, then the write to them, answered at the quorum; so one slow peer among
//! the closest delays a store by the budget instead of failing it. Bootstraps answer when no
//! buckets remain to refresh.
//! Inbound PUTs (`StoreInserts::FilterBoth`) are validated and merged by our own store here too.

use std::collections::HashMap;
use std::future::Future;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};

use libp2p::kad::{self, GetRecordOk, QueryId, QueryResult, Quorum, Record, RecordKey};
use starling_dht::{now_ms, DhtStore, DictionaryRecord, Validator};
use tokio::sync::oneshot;

use super::{BootstrapReport, PutReport};
use crate::NodeError;

/// The Kademlia behaviour of a Starling node, over our validating store.
pub(super) type Kad = kad::Behaviour<DhtStore>;

/// Where the answer to a caller's request goes.
pub(super) type Reply<T> = oneshot::Sender<Result<T, NodeError>>;

/// What a GET waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GetMode {
    /// The first valid record with a live entry.
    First,
    /// Every record the query finds, merged.
    Latest,
}

/// A GET in flight: what has been found so far.
struct PendingGet {
    mode: GetMode,
    key: RecordKey,
    merged: DictionaryRecord,
    reply: Reply<Option<DictionaryRecord>>,
}

/// A PUT whose lookup of the closest peers is in flight.
struct PendingLookup {
    record: Record,
    key: String,
    reply: Reply<PutReport>,
}

/// How long the closest peers found for a key are written to without a new lookup.
const CLOSEST_TTL: Duration = Duration::from_secs(5);
/// Peers in a full lookup answer (libp2p-kad's K).
const CLOSEST_FULL: usize = 20;
/// Keys whose closest peers are kept, at most.
const MAX_CLOSEST_KEPT: usize = 1024;

/// A lookup's budget: resolves to its query id when the budget is spent.
type Deadline = Pin<Box<dyn Future<Output = QueryId> + Send>>;

/// Every Kademlia query the swarm task has started and not yet answered.
pub(super) struct Queries {
    /// PUTs in their first step (finding the closest peers).
    lookups: HashMap<QueryId, PendingLookup>,
    /// When each of those lookups is cut short.
    deadlines: FuturesUnordered<Deadline>,
    /// How long a PUT's lookup may take before the write goes to the closest peers found.
    lookup_budget: Duration,
    /// How long a latest GET that already holds a live entry waits for the rest of its query.
    get_budget: Duration,
    /// PUTs in their second step, with the key (for the error message) and the caller's reply.
    puts: HashMap<QueryId, (String, Reply<PutReport>)>,
    /// Of those, the writes sent to kept closest peers without a lookup, with their record
    /// (written again after a lookup if they miss their quorum).
    unlooked: HashMap<QueryId, Record>,
    /// The closest peers the latest lookup found for each key, and when.
    closest: HashMap<Vec<u8>, (Vec<libp2p::PeerId>, tokio::time::Instant)>,
    gets: HashMap<QueryId, PendingGet>,
    /// Bootstraps in flight, with the peers their steps have heard from and failed to reach.
    bootstraps: HashMap<QueryId, (Reply<BootstrapReport>, BootstrapReport)>,
    /// Checks records that GETs bring back.
    validator: Validator,
    /// Peers that must acknowledge a PUT (at least 1).
    put_quorum: usize,
}

impl Queries {
    /// `lookup_budget`: how long a PUT's lookup of the closest peers may run; `get_budget`:
    /// how long a latest GET may run once it holds a live entry.
    pub(super) fn new(
        validator: Validator,
        put_quorum: usize,
        lookup_budget: Duration,
        get_budget: Duration,
    ) -> Self {
        Queries {
            lookups: HashMap::new(),
            deadlines: FuturesUnordered::new(),
            lookup_budget,
            get_budget,
            puts: HashMap::new(),
            unlooked: HashMap::new(),
            closest: HashMap::new(),
            gets: HashMap::new(),
            bootstraps: HashMap::new(),
            validator,
            put_quorum: put_quorum.max(1),
        }
    }

    /// Stores `record` locally and looks up the peers closest to its key; the write to them
    /// follows when the lookup ends or its budget is spent ([`Self::on_deadline`]), and
    /// `reply` is answered once the quorum acknowledged it (or could not).
    pub(super) fn put(&mut self, kad: &mut Kad, record: Record, reply: Reply<PutReport>) {
        use kad::store::RecordStore;
        let key = String::from_utf8_lossy(record.key.as_ref()).into_owned();
        if let Err(e) = kad.store_mut().put(record.clone()) {
            let _ = reply.send(Err(NodeError::Dht(starling_dht::DhtError::StoreFull(
                match e {
                    kad::store::Error::MaxRecords => "too many records",
                    _ => "record refused by local store",
                },
            ))));
            return;
        }
        let kept = self
            .closest
            .get(record.key.as_ref())
            .filter(|(peers, at)| !peers.is_empty() && at.elapsed() < CLOSEST_TTL)
            .map(|(peers, _)| peers.clone());
        match kept {
            Some(peers) => {
                let write = kad.put_record_to(record.clone(), peers.into_iter(), self.quorum());
                self.puts.insert(write, (key, reply));
                self.unlooked.insert(write, record);
            }
            None => self.look_up_and_put(kad, record, key, reply),
        }
    }

    /// A PUT's first step: the lookup of the closest peers to its key.
    fn look_up_and_put(
        &mut self,
        kad: &mut Kad,
        record: Record,
        key: String,
        reply: Reply<PutReport>,
    ) {
        let id = kad.get_closest_peers(record.key.to_vec());
        self.lookups
            .insert(id, PendingLookup { record, key, reply });
        self.push_deadline(id, self.lookup_budget);
    }

    fn quorum(&self) -> Quorum {
        Quorum::N(NonZeroUsize::new(self.put_quorum).unwrap_or(NonZeroUsize::MIN))
    }

    /// Keeps `peers` as the closest to `key` for [`CLOSEST_TTL`] (when there is room).
    fn keep_closest(&mut self, key: &[u8], peers: Vec<libp2p::PeerId>) {
        if self.closest.len() >= MAX_CLOSEST_KEPT && !self.closest.contains_key(key) {
            self.closest.retain(|_, (_, at)| at.elapsed() < CLOSEST_TTL);
            if self.closest.len() >= MAX_CLOSEST_KEPT {
                return;
            }
        }
        self.closest
            .insert(key.to_vec(), (peers, tokio::time::Instant::now()));
    }

    /// Query `id` is looked at again ([`Self::on_deadline`]) once `budget` is spent.
    fn push_deadline(&mut self, id: QueryId, budget: Duration) {
        self.deadlines.push(Box::pin(async move {
            tokio::time::sleep(budget).await;
            id
        }));
    }

    /// The next lookup whose budget is spent; pending forever while there is none (for the
    /// swarm task's `select!`).
    pub(super) async fn next_deadline(&mut self) -> QueryId {
        match self.deadlines.next().await {
            Some(id) => id,
            None => std::future::pending().await,
        }
    }

    /// A query ran out of budget. A PUT's lookup: end it, so that it reports the closest peers
    /// that answered so far and the write goes to them. A latest GET that holds a live entry:
    /// end it, so that it answers with what it merged (the local store's record and the peers
    /// that answered); one that holds none runs on to the query timeout, since nothing found
    /// yet is worth the whole lookup. (A query that already ended is ignored.)
    pub(super) fn on_deadline(&mut self, kad: &mut Kad, id: QueryId) {
        let what = if self.lookups.contains_key(&id) {
            "DHT put: lookup over budget, writing to the closest found"
        } else if let Some(pending) = self.gets.get_mut(&id) {
            pending.merged.remove_expired(now_ms());
            if pending.merged.is_empty() {
                return;
            }
            "DHT get: over budget, answering with the records found so far"
        } else {
            return;
        };
        if let Some(mut q) = kad.query_mut(&id) {
            tracing::debug!(?id, "{what}");
            q.finish();
        }
    }

    /// A PUT's lookup ended with `peers` (closest first): write the record to them.
    fn write_to_closest(&mut self, kad: &mut Kad, id: QueryId, peers: Vec<kad::PeerInfo>) {
        let Some(PendingLookup { record, key, reply }) = self.lookups.remove(&id) else {
            return;
        };
        if peers.is_empty() {
            let _ = reply.send(Err(NodeError::QuorumFailed {
                key,
                acknowledged: 0,
                required: self.put_quorum,
            }));
            return;
        }
        let peers: Vec<libp2p::PeerId> = peers.into_iter().map(|p| p.peer_id).collect();
        // Kept only when the lookup found as many peers as a full answer has (K, or the whole
        // routing table of a smaller swarm): one cut short would leave peers out for the TTL.
        let known: usize = kad.kbuckets().map(|b| b.num_entries()).sum();
        if peers.len() >= known.min(CLOSEST_FULL) {
            self.keep_closest(record.key.as_ref(), peers.clone());
        }
        let write = kad.put_record_to(record, peers.into_iter(), self.quorum());
        self.puts.insert(write, (key, reply));
    }

    /// Sends `record` to `peers` as it is (no local store, no validation): fault injection.
    #[cfg(feature = "testing")]
    pub(super) fn put_to(
        &mut self,
        kad: &mut Kad,
        record: Record,
        peers: Vec<libp2p::PeerId>,
        reply: Reply<PutReport>,
    ) {
        let key = String::from_utf8_lossy(record.key.as_ref()).into_owned();
        let id = kad.put_record_to(record, peers.into_iter(), Quorum::One);
        self.puts.insert(id, (key, reply));
    }

    /// Looks `key` up across the swarm.
    pub(super) fn get(
        &mut self,
        kad: &mut Kad,
        key: RecordKey,
        mode: GetMode,
        reply: Reply<Option<DictionaryRecord>>,
    ) {
        let id = kad.get_record(key.clone());
        if mode == GetMode::Latest {
            self.push_deadline(id, self.get_budget);
        }
        self.gets.insert(
            id,
            PendingGet {
                mode,
                key,
                merged: DictionaryRecord::default(),
                reply,
            },
        );
    }

    /// Refreshes the routing table through known peers.
    pub(super) fn bootstrap(&mut self, kad: &mut Kad, reply: Reply<BootstrapReport>) {
        match kad.bootstrap() {
            Ok(id) => {
                self.bootstraps
                    .insert(id, (reply, BootstrapReport::default()));
            }
            Err(_) => {
                let _ = reply.send(Err(NodeError::Bootstrap {
                    tried: 0,
                    attempts: 1,
                    last_error: "no known peers".into(),
                }));
            }
        }
    }

    /// Handles one Kademlia event: merges inbound PUTs into our store, advances and answers
    /// queries.
    pub(super) fn on_event(&mut self, kad: &mut Kad, event: kad::Event) {
        match event {
            kad::Event::InboundRequest {
                request:
                    kad::InboundRequest::PutRecord {
                        source,
                        record: Some(record),
                        ..
                    },
            } => {
                let store = kad.store_mut();
                if let Err(e) =
                    store.insert(record.key.as_ref(), &record.value, Some(source), now_ms())
                {
                    tracing::debug!(%source, "refused inbound record: {e}");
                }
            }
            kad::Event::OutboundQueryProgressed {
                id,
                result,
                step,
                stats,
            } => {
                // Every step of a bootstrap is a lookup of its own, with its own statistics.
                if let Some((_, report)) = self.bootstraps.get_mut(&id) {
                    report.answered += stats.num_successes();
                    report.failed += stats.num_failures();
                }
                self.on_progress(kad, id, result, step.last)
            }
            _ => {}
        }
    }

    fn on_progress(&mut self, kad: &mut Kad, id: QueryId, result: QueryResult, last: bool) {
        match result {
            QueryResult::GetRecord(Ok(GetRecordOk::FoundRecord(peer_record))) => {
                let mut done = last;
                if let Some(pending) = self.gets.get_mut(&id) {
                    match self.validator.validate(
                        peer_record.record.key.as_ref(),
                        &peer_record.record.value,
                        now_ms(),
                    ) {
                        Ok((_, record)) => {
                            pending.merged.merge(record);
                        }
                        Err(e) => {
                            tracing::debug!(peer = ?peer_record.peer, "dropped invalid record from GET: {e}");
                        }
                    }
                    if pending.mode == GetMode::First {
                        pending.merged.remove_expired(now_ms());
                        if !pending.merged.is_empty() {
                            done = true;
                            if let Some(mut q) = kad.query_mut(&id) {
                                q.finish();
                            }
                        }
                    }
                }
                if done {
                    self.finish_get(kad, id, Vec::new());
                }
            }
            QueryResult::GetRecord(Ok(GetRecordOk::FinishedWithNoAdditionalRecord {
                cache_candidates,
            })) if last => self.finish_get(kad, id, cache_candidates.into_values().collect()),
            QueryResult::GetRecord(_) if last => self.finish_get(kad, id, Vec::new()),
            QueryResult::GetClosestPeers(result) => {
                let peers = match result {
                    Ok(ok) => ok.peers,
                    Err(kad::GetClosestPeersError::Timeout { peers, .. }) => peers,
                };
                self.write_to_closest(kad, id, peers);
            }
            QueryResult::PutRecord(result) => {
                let unlooked = self.unlooked.remove(&id);
                if let (Err(_), Some(record)) = (&result, unlooked) {
                    // Written to kept closest peers and missed its quorum (one of them left, or
                    // closer ones joined): forget them and write again after a lookup.
                    self.closest.remove(record.key.as_ref());
                    if let Some((key, reply)) = self.puts.remove(&id) {
                        self.look_up_and_put(kad, record, key, reply);
                    }
                    return;
                }
                if let Some((key, reply)) = self.puts.remove(&id) {
                    let r = match result {
                        Ok(_) => Ok(PutReport {
                            acknowledged: self.put_quorum,
                        }),
                        Err(kad::PutRecordError::QuorumFailed {
                            success, quorum, ..
                        })
                        | Err(kad::PutRecordError::Timeout {
                            success, quorum, ..
                        }) => Err(NodeError::QuorumFailed {
                            key,
                            acknowledged: success.len(),
                            required: quorum.get(),
                        }),
                    };
                    let _ = reply.send(r);
                }
            }
            QueryResult::Bootstrap(result) => {
                let done = match &result {
                    Ok(ok) => ok.num_remaining == 0,
                    Err(_) => true,
                } || last;
                if done {
                    if let Some((reply, mut report)) = self.bootstraps.remove(&id) {
                        report.routing_table =
                            kad.kbuckets().map(|b| b.num_entries()).sum::<usize>();
                        let _ = reply.send(
                            result
                                .map(|_| report)
                                .map_err(|_| NodeError::Timeout("bootstrap")),
                        );
                    }
                }
            }
            _ => {}
        }
    }

    /// Answers a GET with what it found, expired entries removed (`None` when nothing is live),
    /// and writes a latest GET's merged record back to `lacking` (the closest peers that
    /// answered without it; fire and forget).
    fn finish_get(&mut self, kad: &mut Kad, id: QueryId, lacking: Vec<libp2p::PeerId>) {
        if let Some(mut pending) = self.gets.remove(&id) {
            pending.merged.remove_expired(now_ms());
            if pending.mode == GetMode::Latest && !lacking.is_empty() && !pending.merged.is_empty()
            {
                let record = Record::new(pending.key.clone(), pending.merged.encode());
                kad.put_record_to(record, lacking.into_iter(), Quorum::One);
            }
            let result = (!pending.merged.is_empty()).then_some(pending.merged);
            let _ = pending.reply.send(Ok(result));
        }
    }
}
