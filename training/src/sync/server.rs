//! The donor side: [`StateServer`] holds the latest snapshot, announces it in the DHT and
//! serves its manifest and chunks on [`PROTOCOL`].
//!
//! CPU: [`StateServer::update`] hashes a snapshot's chunks (SHA-256) and announces it at
//! once; [`StateServer::refresh`], for a peer that steps often, swaps the snapshot in and
//! leaves the hashing to the first hello that asks for it and to the next announcement (at
//! most one per `announce_min_interval`): a swarm stepping every 15 ms no longer hashes its
//! whole state and stores a signed DHT record at every step.
//!
//! Memory: one snapshot at rest. [`StateServer::update`] replaces it; a session keeps the
//! snapshot its hello announced until the session ends, so a joiner finishes the manifest it
//! started on however often the donor steps (a model that steps every few milliseconds would
//! otherwise replace it between the manifest and the chunks). At most one older snapshot per
//! open session is alive, and sessions are bounded in number and close when idle past the
//! request timeout. A chunk of a manifest no session holds is answered "stale". Bounds: at most `max_sessions` streams in all and
//! `max_sessions_per_peer` from one peer (others are answered busy), one request at a time per
//! stream, a request timeout on every read and write, frames no larger than a chunk.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use starling_node::lock::lock;

use futures::AsyncWriteExt;
use starling_dht::now_ms;
use starling_node::framing::{encode_msg, read_msg, write_msg, write_tagged_frame, FrameError};
use starling_node::streams::{serve_inbound, InboundLimits};
use starling_node::{Node, NodeError, PeerId, Stream};
use tokio::sync::{watch, Notify, OwnedRwLockWriteGuard, OwnedSemaphorePermit, RwLock, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tracing::Instrument;

use super::manifest::{sha256, ChunkSpan, Digest, Manifest, StateAnnouncement};
use super::snapshot::{le_bytes, StateSnapshot};
use super::wire::{
    Hello, HelloReply, Reply, Request, MAX_CONTROL_BYTES, PROTOCOL, TAG_CHUNK, TAG_MANIFEST,
    TAG_REPLY, WIRE_VERSION,
};
use super::{StateServerConfig, SyncError};

/// What a [`StateServer`] serves now (returned by [`StateServer::update`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The snapshot's epoch.
    pub epoch: u64,
    /// SHA-256 of its manifest (what the DHT announcement names).
    pub manifest_hash: Digest,
    /// Chunks in it.
    pub chunks: u64,
    /// Bytes of chunk data in it.
    pub bytes: u64,
}

/// Counters of a [`StateServer`] since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Chunks written.
    pub chunks_served: u64,
    /// Bytes of chunk data written.
    pub bytes_served: u64,
    /// Manifests written.
    pub manifests_served: u64,
    /// Streams answered busy (over a session bound).
    pub busy_refusals: u64,
    /// Chunk requests answered stale (the snapshot had moved on).
    pub stale_requests: u64,
}

/// The snapshot being served, and what its manifest says once hashed.
struct Current {
    snapshot: StateSnapshot,
    chunk_elems: usize,
    /// Hashed when first needed (a joiner's hello, an announcement, [`StateServer::served`]):
    /// a peer that steps every few milliseconds does not hash states nobody asks for.
    hashed: OnceLock<Hashed>,
}

/// A snapshot's manifest: the chunks' places, its encoding and what it announces.
struct Hashed {
    spans: Vec<ChunkSpan>,
    manifest_bytes: Vec<u8>,
    served: Served,
}

impl Current {
    fn new(snapshot: StateSnapshot, chunk_elems: usize) -> Current {
        Current {
            snapshot,
            chunk_elems,
            hashed: OnceLock::new(),
        }
    }

    /// The manifest, hashed now if it was not yet (a pass over the whole state: call it on a
    /// blocking thread, or through [`hashed`]).
    fn hash_now(&self) -> &Hashed {
        self.hashed.get_or_init(|| {
            let manifest = Manifest::of(&self.snapshot, self.chunk_elems);
            let spans = manifest.spans().unwrap_or_default();
            let manifest_bytes = manifest.encode();
            let served = Served {
                epoch: manifest.epoch,
                manifest_hash: sha256(&manifest_bytes),
                chunks: spans.len() as u64,
                bytes: 4 * spans.iter().map(|s| s.range.len() as u64).sum::<u64>(),
            };
            Hashed {
                spans,
                manifest_bytes,
                served,
            }
        })
    }

    /// Whether this snapshot's buffers and counters have the same names (and the buffers the
    /// same lengths) as `other`'s: then their manifests have the same size.
    fn same_layout(&self, other: &StateSnapshot) -> bool {
        let a = self.snapshot.buffers.iter().map(|(n, v)| (n, v.len()));
        a.eq(other.buffers.iter().map(|(n, v)| (n, v.len())))
            && self.snapshot.counters.keys().eq(other.counters.keys())
    }
}

/// `current`'s manifest, hashed on a blocking thread if it was not yet.
async fn hashed(current: &Arc<Current>) -> &Hashed {
    if current.hashed.get().is_none() {
        let c = current.clone();
        // A panic while hashing is not expected; the fallback below hashes here then.
        let _ = tokio::task::spawn_blocking(move || {
            c.hash_now();
        })
        .await;
    }
    current.hash_now()
}

/// Manifests whose receivers [`StateServer::recent_joiners`] remembers.
pub const RECENT_JOINERS: usize = 8;

#[derive(Default)]
struct Counters {
    chunks: AtomicU64,
    bytes: AtomicU64,
    manifests: AtomicU64,
    busy: AtomicU64,
    stale: AtomicU64,
    /// Chunk requests that reached the fault point.
    #[cfg(feature = "testing")]
    fault_requests: AtomicU64,
}

/// What the server's tasks share.
struct Shared {
    node: Node,
    cfg: StateServerConfig,
    current: Mutex<Option<Arc<Current>>>,
    /// Woken by [`StateServer::refresh`]: the announcement loop announces the new state, at
    /// most once per `announce_min_interval`.
    refreshed: Notify,
    /// When the last announcement was made.
    announced_at: Mutex<Option<Instant>>,
    sessions: Arc<Semaphore>,
    /// Read for a moment by each session as it takes the state it serves; written by a
    /// [`ServeHold`].
    hold: Arc<RwLock<()>>,
    per_peer: Mutex<HashMap<PeerId, usize>>,
    /// The peers the last [`RECENT_JOINERS`] manifests went to, oldest first.
    joiners: Mutex<VecDeque<PeerId>>,
    counters: Counters,
    stop: watch::Receiver<bool>,
    #[cfg(feature = "testing")]
    hung: watch::Sender<bool>,
}

struct Inner {
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// A donor: serves this peer's latest training state to joiners (see the module docs of
/// [`sync`](super)). Cheap to clone; every clone is the same server. Stops on
/// [`StateServer::shutdown`] or when the last clone is dropped.
///
/// ```no_run
/// # async fn demo(node: starling_node::Node, params: starling_training::ParamSet, opt: starling_training::Sgd) -> Result<(), Box<dyn std::error::Error>> {
/// use starling_training::sync::{StateServer, StateServerConfig, StateView};
/// let server = StateServer::start(node, StateServerConfig::new("my-run"))?;
/// // After every global step (the collaborative optimizer's `serve_state` does this itself):
/// let served = server.update(StateView::new(3, &params).optimizer("opt", &opt).capture()?).await?;
/// println!("serving epoch {} in {} chunks", served.epoch, served.chunks);
/// server.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct StateServer {
    inner: Arc<Inner>,
}

impl StateServer {
    /// Starts serving on `node` (nothing until the first [`StateServer::update`]). Fails when
    /// another state server already serves this node, or the configuration is invalid.
    pub fn start(node: Node, cfg: StateServerConfig) -> Result<StateServer, SyncError> {
        cfg.validate()?;
        let incoming = node
            .stream_control()
            .accept(PROTOCOL)
            .map_err(|_| SyncError::AlreadyServing)?;
        let (stop_tx, stop) = watch::channel(false);
        let shared = Arc::new(Shared {
            sessions: Arc::new(Semaphore::new(cfg.max_sessions)),
            hold: Arc::new(RwLock::new(())),
            node: node.clone(),
            cfg,
            current: Mutex::new(None),
            refreshed: Notify::new(),
            announced_at: Mutex::new(None),
            per_peer: Mutex::new(HashMap::new()),
            joiners: Mutex::new(VecDeque::new()),
            counters: Counters::default(),
            stop,
            #[cfg(feature = "testing")]
            hung: watch::channel(false).0,
        });
        let limits = InboundLimits {
            max_pending: shared.cfg.max_sessions,
            first_message_timeout: shared.cfg.request_timeout,
            max_first_message: MAX_CONTROL_BYTES,
        };
        let handler = {
            let shared = shared.clone();
            move |peer, hello: Hello, stream| session(shared.clone(), peer, hello, stream)
        };
        let mut stop_accept = shared.stop.clone();
        let accept_node = node.clone();
        let accept = async move {
            tokio::select! {
                _ = serve_inbound(incoming, limits, handler) => {}
                _ = stop_accept.changed() => {}
                _ = accept_node.closed() => {}
            }
        };
        let announce = announce_loop(shared.clone());
        let tasks = vec![
            tokio::spawn(accept.instrument(node.span())),
            tokio::spawn(announce.instrument(node.span())),
        ];
        Ok(StateServer {
            inner: Arc::new(Inner {
                shared,
                stop: stop_tx,
                tasks: Mutex::new(tasks),
            }),
        })
    }

    /// Serves `snapshot` from now on, in place of the previous one: hashes its chunks (on a
    /// blocking thread), swaps it in, and announces it in the DHT (a failed announcement is
    /// logged and retried by the periodic announcement).
    pub async fn update(&self, snapshot: StateSnapshot) -> Result<Served, SyncError> {
        let shared = &self.inner.shared;
        if *shared.stop.borrow() {
            return Err(SyncError::Stopped);
        }
        let current = Arc::new(Current::new(snapshot, shared.cfg.chunk_elems));
        let (served, manifest_len) = {
            let h = hashed(&current).await;
            (h.served.clone(), h.manifest_bytes.len())
        };
        if manifest_len > shared.cfg.max_manifest_bytes {
            return Err(SyncError::Invalid(format!(
                "the manifest takes {manifest_len} bytes, over max_manifest_bytes {}: raise chunk_elems",
                shared.cfg.max_manifest_bytes
            )));
        }
        *lock(&shared.current) = Some(current);
        if let Err(e) = announce(shared).await {
            tracing::debug!("state announcement failed (retried later): {e}");
        }
        Ok(served)
    }

    /// Serves `snapshot` from now on, like [`update`](Self::update), for a peer that refreshes
    /// its state often (the collaborative optimizer does after every step): the snapshot is
    /// swapped in at once; its manifest is hashed only when first needed (a joiner's hello,
    /// an announcement), and it is announced in the background, at most once per
    /// [`announce_min_interval`](StateServerConfig::announce_min_interval) (the newest state
    /// then). A joiner that reads an older announcement gets the newest state from the
    /// donor's hello. The first snapshot, and one of another layout, go through `update`
    /// (hashed, checked against `max_manifest_bytes` and announced before this returns).
    ///
    /// ```no_run
    /// # async fn demo(server: starling_training::sync::StateServer, params: starling_training::ParamSet) -> Result<(), starling_training::sync::SyncError> {
    /// use starling_training::sync::StateView;
    /// for epoch in 1..100 {
    ///     // ... a global step ...
    ///     server.refresh(StateView::new(epoch, &params).capture()?).await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn refresh(&self, snapshot: StateSnapshot) -> Result<(), SyncError> {
        let shared = &self.inner.shared;
        if *shared.stop.borrow() {
            return Err(SyncError::Stopped);
        }
        let previous = lock(&shared.current).clone();
        if !previous.is_some_and(|p| p.same_layout(&snapshot)) {
            return self.update(snapshot).await.map(|_| ());
        }
        *lock(&shared.current) = Some(Arc::new(Current::new(snapshot, shared.cfg.chunk_elems)));
        shared.refreshed.notify_one();
        Ok(())
    }

    /// What is served now, if anything (hashing it here if nothing did yet).
    pub fn served(&self) -> Option<Served> {
        let current = lock(&self.inner.shared.current).clone();
        current.map(|c| c.hash_now().served.clone())
    }

    /// Joiners' sessions open now: each is a joiner fetching this peer's state (or about to,
    /// or done and not yet closed).
    ///
    /// ```no_run
    /// # fn demo(server: &starling_training::StateServer) {
    /// if server.sessions_open() > 0 {
    ///     println!("a joiner is fetching this peer's state");
    /// }
    /// # }
    /// ```
    pub fn sessions_open(&self) -> usize {
        let shared = &self.inner.shared;
        shared
            .cfg
            .max_sessions
            .saturating_sub(shared.sessions.available_permits())
    }

    /// Holds new sessions off the state served now, which its owner is about to replace: a
    /// session opened while the hold lives waits for it to end (at most [`HOLD_WAIT`]) before
    /// it takes the state it serves, so it gets the replacement. `None` while a session is
    /// taking the state at this moment (it is then counted by [`StateServer::sessions_open`]).
    /// The collaborative optimizer, alone in its run, takes one before it looks for joiners
    /// and keeps it until the state of the step it then takes is in: without it, a joiner
    /// whose hello came between that look and the step got the state the donor was leaving,
    /// and had to sync again.
    ///
    /// ```no_run
    /// # async fn demo(server: starling_training::sync::StateServer, params: starling_training::ParamSet) -> Result<(), starling_training::sync::SyncError> {
    /// use starling_training::sync::StateView;
    /// if server.sessions_open() == 0 {
    ///     let hold = server.hold();
    ///     // ... a step nobody else takes part in ...
    ///     server.refresh(StateView::new(8, &params).capture()?).await?;
    ///     drop(hold); // sessions opened meanwhile serve epoch 8
    /// }
    /// # Ok(()) }
    /// ```
    pub fn hold(&self) -> Option<ServeHold> {
        let hold = self.inner.shared.hold.clone().try_write_owned().ok()?;
        Some(ServeHold { _guard: hold })
    }

    /// The peers the last [`RECENT_JOINERS`] manifests went to (a peer once per manifest it
    /// fetched), oldest first: the joiners that fetched this peer's state lately.
    ///
    /// ```no_run
    /// # fn demo(server: starling_training::sync::StateServer) {
    /// let fetched = server.stats().manifests_served;
    /// let last = server.recent_joiners().last().copied();
    /// println!("{fetched} manifests served, the last to {last:?}");
    /// # }
    /// ```
    pub fn recent_joiners(&self) -> Vec<PeerId> {
        lock(&self.inner.shared.joiners).iter().copied().collect()
    }

    /// Counters since the server started.
    pub fn stats(&self) -> ServerStats {
        let c = &self.inner.shared.counters;
        ServerStats {
            chunks_served: c.chunks.load(Ordering::Relaxed),
            bytes_served: c.bytes.load(Ordering::Relaxed),
            manifests_served: c.manifests.load(Ordering::Relaxed),
            busy_refusals: c.busy.load(Ordering::Relaxed),
            stale_requests: c.stale.load(Ordering::Relaxed),
        }
    }

    /// Resolves once the `hang_after_chunks` fault has fired (tests only).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub async fn hung(&self) {
        let mut rx = self.inner.shared.hung.subscribe();
        let _ = rx.wait_for(|h| *h).await;
    }

    /// Stops accepting and announcing, ends every session, and waits (at most one request
    /// timeout) for them to finish. The DHT announcement expires by itself.
    pub async fn shutdown(&self) {
        let _ = self.inner.stop.send(true);
        let tasks: Vec<_> = lock(&self.inner.tasks).drain(..).collect();
        for task in tasks {
            let _ = task.await;
        }
        let shared = &self.inner.shared;
        let all = shared.cfg.max_sessions as u32;
        let _ = timeout(
            shared.cfg.request_timeout,
            shared.sessions.acquire_many(all),
        )
        .await;
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// The longest a new session waits on a [`ServeHold`]: a lone donor's step (an optimizer step
/// and a copy of its state) takes milliseconds, and the collaborative optimizer's hold ends
/// with its step (at once when it does not step after all); this bounds a holder that does
/// not let go.
pub const HOLD_WAIT: Duration = Duration::from_secs(2);

/// New sessions held off a [`StateServer`]'s state (see [`StateServer::hold`]); released on
/// drop.
#[must_use = "the hold ends when this is dropped"]
pub struct ServeHold {
    _guard: OwnedRwLockWriteGuard<()>,
}

/// Publishes what is served now under `{run}.state`, signed by this peer.
async fn announce(shared: &Shared) -> Result<(), SyncError> {
    let Some(current) = lock(&shared.current).clone() else {
        return Ok(());
    };
    *lock(&shared.announced_at) = Some(Instant::now());
    let served = hashed(&current).await.served.clone();
    let t = shared.cfg.request_timeout;
    let node = &shared.node;
    let addrs = timeout(t, node.listen_addrs())
        .await
        .map_err(|_| SyncError::Timeout(t))??;
    let value = StateAnnouncement {
        epoch: served.epoch,
        schema_hash: current.snapshot.schema_hash,
        manifest_hash: served.manifest_hash,
        chunks: served.chunks,
        bytes: served.bytes,
        addrs: addrs.iter().take(8).map(|a| a.to_string()).collect(),
    };
    let expires = now_ms() + shared.cfg.announce_ttl.as_millis() as u64;
    let key = super::state_key(&shared.cfg.run);
    match timeout(t, node.store(&key, &node.owner_marker(), &value, expires))
        .await
        .map_err(|_| SyncError::Timeout(t))?
    {
        // No peer acknowledged it (a run's first peer): its own store answers joiners' reads.
        Ok(_) | Err(NodeError::QuorumFailed { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Renews the announcement every `announce_every` until stopped or until this peer's node
/// stops (a dead peer's announcement then expires by itself, `announce_ttl` after its last
/// renewal).
async fn announce_loop(shared: Arc<Shared>) {
    let mut stop = shared.stop.clone();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(shared.cfg.announce_every) => {}
            _ = shared.refreshed.notified() => {
                // A refreshed state: announced once the last announcement is
                // `announce_min_interval` old (refreshes meanwhile coalesce into this one).
                let last = *lock(&shared.announced_at);
                let wait = last.map_or(Duration::ZERO, |t| {
                    shared.cfg.announce_min_interval.saturating_sub(t.elapsed())
                });
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.changed() => return,
                    _ = shared.node.closed() => return,
                }
            }
            _ = stop.changed() => return,
            _ = shared.node.closed() => return,
        }
        let renewed = tokio::select! {
            r = announce(&shared) => r,
            _ = stop.changed() => return,
        };
        if let Err(e) = renewed {
            tracing::debug!("state announcement failed: {e}");
        }
    }
}

/// A session's claim on the bounds; released on drop.
struct Admission {
    shared: Arc<Shared>,
    peer: PeerId,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut per_peer = lock(&self.shared.per_peer);
        if let Some(n) = per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                per_peer.remove(&self.peer);
            }
        }
    }
}

fn admit(shared: &Arc<Shared>, peer: PeerId) -> Option<Admission> {
    let permit = shared.sessions.clone().try_acquire_owned().ok()?;
    let mut per_peer = lock(&shared.per_peer);
    let n = per_peer.entry(peer).or_insert(0);
    if *n >= shared.cfg.max_sessions_per_peer {
        return None;
    }
    *n += 1;
    Some(Admission {
        shared: shared.clone(),
        peer,
        _permit: permit,
    })
}

/// Serves one joiner's stream: the hello, then one request at a time until the joiner closes
/// it, it idles past the request timeout, or the server stops.
async fn session(shared: Arc<Shared>, peer: PeerId, hello: Hello, mut stream: Stream) {
    let mut stop = shared.stop.clone();
    if *stop.borrow() {
        return;
    }
    let t = shared.cfg.request_timeout;
    let admission = admit(&shared, peer);
    // The snapshot this session serves: the one its hello announces, kept for the session;
    // the next one if its owner holds this one (see `StateServer::hold`).
    // (A session refused as busy is answered at once.)
    let hold = if admission.is_some() {
        timeout(HOLD_WAIT, shared.hold.read()).await.ok()
    } else {
        None
    };
    let pinned = lock(&shared.current).clone();
    drop(hold);
    if let Some(c) = &pinned {
        hashed(c).await;
    }
    let reply = match (&admission, &pinned) {
        _ if hello.version != WIRE_VERSION => HelloReply::Unsupported {
            version: WIRE_VERSION,
        },
        (None, _) => {
            shared.counters.busy.fetch_add(1, Ordering::Relaxed);
            HelloReply::Busy
        }
        (Some(_), None) => HelloReply::NoState,
        (Some(_), Some(c)) => {
            let served = &c.hash_now().served;
            HelloReply::Ready {
                epoch: served.epoch,
                manifest_hash: served.manifest_hash,
            }
        }
    };
    let ready = matches!(reply, HelloReply::Ready { .. });
    if timeout(t, write_msg(&mut stream, &reply)).await.is_err() || !ready {
        return;
    }
    loop {
        let request = tokio::select! {
            r = timeout(t, read_msg::<_, Request>(&mut stream, MAX_CONTROL_BYTES)) => r,
            _ = stop.changed() => return,
        };
        let Ok(Ok(request)) = request else {
            return; // idle past the timeout, closed, or not a request
        };
        let answered = tokio::select! {
            r = timeout(t, answer(&shared, peer, pinned.as_deref(), &mut stream, request)) => r,
            _ = stop.changed() => return,
        };
        match answered {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) | Ok(Err(_)) | Err(_) => return,
        }
    }
}

/// Answers one request from the session's `pinned` snapshot (or the current one, when a
/// chunk of that is asked for); `Ok(false)` ends the session.
async fn answer(
    shared: &Shared,
    peer: PeerId,
    pinned: Option<&Current>,
    stream: &mut Stream,
    request: Request,
) -> Result<bool, FrameError> {
    let current = lock(&shared.current).clone();
    // (The pinned snapshot was hashed for the hello; the current one, if it is another, only
    // if something asked for it: a chunk request names a manifest some hello announced.)
    let serving = match &request {
        Request::Manifest => pinned.and_then(|c| Some((c, c.hashed.get()?))),
        Request::Chunk { manifest_hash, .. } => [pinned, current.as_deref()]
            .into_iter()
            .flatten()
            .find_map(|c| {
                let h = c.hashed.get()?;
                (h.served.manifest_hash == *manifest_hash).then_some((c, h))
            }),
    };
    let reply = match (&request, serving) {
        (_, None) => {
            shared.counters.stale.fetch_add(1, Ordering::Relaxed);
            let now = match &current {
                Some(c) => {
                    let served = &hashed(c).await.served;
                    Some((served.epoch, served.manifest_hash))
                }
                None => None,
            };
            Reply::Stale { now }
        }
        (Request::Manifest, Some((_, h))) => {
            write_tagged_frame(stream, TAG_MANIFEST, &[&h.manifest_bytes]).await?;
            stream.flush().await?;
            {
                // Before the count: whoever sees the count sees the joiner too.
                let mut joiners = lock(&shared.joiners);
                if joiners.len() >= RECENT_JOINERS {
                    joiners.pop_front();
                }
                joiners.push_back(peer);
            }
            shared.counters.manifests.fetch_add(1, Ordering::Relaxed);
            return Ok(true);
        }
        (Request::Chunk { index, .. }, Some((c, h))) => {
            let Some(span) = usize::try_from(*index).ok().and_then(|i| h.spans.get(i)) else {
                let reply = Reply::NoSuchChunk {
                    index: *index,
                    chunks: h.spans.len() as u64,
                };
                write_tagged_frame(stream, TAG_REPLY, &[&encode_msg(&reply)?]).await?;
                stream.flush().await?;
                return Ok(false);
            };
            let values = &c.snapshot.buffers[span.buffer].1[span.range.clone()];
            let bytes = le_bytes(values);
            #[cfg(feature = "testing")]
            let bytes = faults::apply(shared, bytes).await;
            write_tagged_frame(stream, TAG_CHUNK, &[&bytes]).await?;
            stream.flush().await?;
            shared.counters.chunks.fetch_add(1, Ordering::Relaxed);
            let n = bytes.len() as u64;
            shared.counters.bytes.fetch_add(n, Ordering::Relaxed);
            return Ok(true);
        }
    };
    write_tagged_frame(stream, TAG_REPLY, &[&encode_msg(&reply)?]).await?;
    stream.flush().await?;
    Ok(true)
}

#[cfg(feature = "testing")]
mod faults {
    use std::borrow::Cow;
    use std::sync::atomic::Ordering;

    use super::Shared;

    /// Applies the configured faults to a chunk about to be written: corrupts it, or hangs
    /// until the server stops once `hang_after_chunks` chunks were served.
    pub(super) async fn apply<'a>(shared: &Shared, bytes: Cow<'a, [u8]>) -> Cow<'a, [u8]> {
        let faults = &shared.cfg.faults;
        let request = shared
            .counters
            .fault_requests
            .fetch_add(1, Ordering::SeqCst);
        if let Some(n) = faults.hang_after_chunks.filter(|&n| request >= n) {
            // Tell the test only once the chunks before this one are written.
            while shared.counters.chunks.load(Ordering::SeqCst) < n {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            shared.hung.send_replace(true);
            // The session's request timeout or the server's stop ends the wait.
            std::future::pending::<()>().await;
        }
        if faults.corrupt_chunks && !bytes.is_empty() {
            let mut owned = bytes.into_owned();
            owned[0] ^= 0x01;
            return Cow::Owned(owned);
        }
        bytes
    }
}
