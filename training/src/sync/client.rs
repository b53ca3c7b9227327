//! The joiner side: [`sync_state`] reads the donors' announcements, takes the manifest they
//! agree on, and fetches and verifies every chunk through [`fetch_chunks`] over
//! `/starling/state/1` streams (see the module docs of [`sync`](super)).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use starling_node::lock::lock;
use std::time::Duration;

use rand::seq::SliceRandom;
use starling_node::framing::{decode_msg, read_tagged_frame_into, write_msg, FrameError};
use starling_node::streams::{open_confirmed, OpenError, Retry};
use starling_node::{Multiaddr, Node, NodeError, PeerId, Stream};
use tokio::time::{timeout, Instant};

use super::fetch::{fetch_chunks, Expected, Plan, Tally, Unfinished};
use super::manifest::{choose_manifest, short, ChunkSpan, Digest, Manifest, ManifestFault};
use super::manifest::{ManifestChoice, StateAnnouncement};
use super::schedule::{Failure, Limits};
use super::snapshot::{StateLayout, SyncedState};
use super::wire::{
    Hello, HelloReply, Reply, Request, MAX_CONTROL_BYTES, PROTOCOL, TAG_CHUNK, TAG_MANIFEST,
    TAG_REPLY, WIRE_VERSION,
};
use super::{state_key, DonorReport, SyncConfig, SyncError, SyncReport};

/// A donor of the chosen manifest, with its idle streams (at most `per_donor_in_flight`).
struct Donor {
    peer: PeerId,
    addrs: Vec<Multiaddr>,
    /// Open streams on the round's manifest (the donor keeps it for them), not in use.
    idle: Mutex<Vec<Stream>>,
    /// Whether a stream on the round's manifest was opened: the donor serves it on those
    /// streams even after it moved on, so a new stream's hello naming another manifest only
    /// means "no more streams", not "stale".
    holds_manifest: AtomicBool,
}

impl Donor {
    fn new(peer: PeerId, addrs: Vec<Multiaddr>) -> Donor {
        Donor {
            peer,
            addrs,
            idle: Mutex::new(Vec::new()),
            holds_manifest: AtomicBool::new(false),
        }
    }
}

/// The addresses an announcement gives (at most 8; unparsable ones dropped).
fn announced_addrs(a: &StateAnnouncement) -> Vec<Multiaddr> {
    a.addrs
        .iter()
        .take(8)
        .filter_map(|s| s.parse().ok())
        .collect()
}

type Failed = (Failure, String);

/// Downloads the training state the donors of `cfg.run` agree on, for a model and optimizers
/// laid out as `layout`, verifying every chunk; writes nothing (apply the result with
/// [`StateTarget::apply`](super::StateTarget::apply) or
/// [`CollaborativeOptimizer::restore_from`](crate::CollaborativeOptimizer::restore_from)).
///
/// Fails with [`SyncError::NoDonors`] when nobody announces a fitting state,
/// [`SyncError::Layout`] when the agreed state does not fit `layout`,
/// [`SyncError::Incomplete`] when every donor failed in every round, and
/// [`SyncError::Deadline`] after `cfg.deadline`.
///
/// ```no_run
/// # async fn demo(node: starling_node::Node, layout: starling_training::sync::StateLayout) -> Result<(), starling_training::sync::SyncError> {
/// use starling_training::sync::{sync_state, SyncConfig};
/// let (synced, report) = sync_state(&node, &SyncConfig::new("my-run"), &layout).await?;
/// for d in &report.donors {
///     println!("{}: {} chunks, {} bad", d.peer, d.chunks, d.bad_chunks);
/// }
/// # let _ = synced; Ok(()) }
/// ```
pub async fn sync_state(
    node: &Node,
    cfg: &SyncConfig,
    layout: &StateLayout,
) -> Result<(SyncedState, SyncReport), SyncError> {
    match timeout(cfg.deadline, rounds(node, cfg, layout)).await {
        Ok(result) => result,
        Err(_) => Err(SyncError::Deadline(cfg.deadline)),
    }
}

/// One round per manifest tried, until one completes or `max_rounds` ran.
async fn rounds(
    node: &Node,
    cfg: &SyncConfig,
    layout: &StateLayout,
) -> Result<(SyncedState, SyncReport), SyncError> {
    let started = Instant::now();
    let deadline = started + cfg.deadline;
    let mut report = SyncReport {
        epoch: 0,
        manifest_hash: [0; 32],
        chunks: 0,
        reused_chunks: 0,
        bytes: 0,
        retries: 0,
        bad_chunks: 0,
        busy: 0,
        stale: 0,
        rounds: 0,
        peak_in_flight: 0,
        seconds: 0.0,
        donors: Vec::new(),
    };
    let mut carried = None;
    let mut last = String::from("no round ran");
    let mut announced_epoch = None;
    let max_rounds = cfg.max_rounds.max(1);
    for round in 1..=max_rounds {
        report.rounds = round;
        if round > 1 {
            tokio::time::sleep(cfg.round_pause).await;
        }
        match one_round(node, cfg, layout, deadline, carried.take(), &mut report).await? {
            Round::Done(synced) => {
                report.seconds = started.elapsed().as_secs_f64();
                return Ok((synced, report));
            }
            Round::Failed { why, kept, epoch } => {
                last = why;
                announced_epoch = announced_epoch.max(Some(epoch));
                carried = kept.or(carried);
            }
        }
    }
    let (chunks, missing) = carried.as_ref().map_or((0, 0), |(m, slots)| {
        let missing = slots.iter().filter(|s| s.is_none()).count();
        (m.chunk_hashes.len(), missing)
    });
    Err(SyncError::Incomplete {
        rounds: max_rounds,
        missing,
        chunks,
        last,
        announced_epoch,
    })
}

/// Verified chunks of a manifest, kept for the next round.
type Kept = (Manifest, Vec<Option<Vec<f32>>>);

/// How a round ended, short of an error that ends the sync.
enum Round {
    /// Every chunk verified.
    Done(SyncedState),
    /// Every donor failed; what was verified is kept. `epoch`: the state's epoch the round
    /// went for.
    Failed {
        why: String,
        kept: Option<Kept>,
        epoch: u64,
    },
}

/// Reads the DHT, takes the agreed manifest and fetches every chunk it does not share with
/// `carried`.
async fn one_round(
    node: &Node,
    cfg: &SyncConfig,
    layout: &StateLayout,
    deadline: Instant,
    carried: Option<Kept>,
    report: &mut SyncReport,
) -> Result<Round, SyncError> {
    let (choice, mut addrs) = find_donors(node, cfg, layout, deadline).await?;
    let mut donors: Vec<Donor> = choice
        .donors
        .iter()
        .map(|&peer| Donor::new(peer, addrs.remove(&peer).unwrap_or_default()))
        .collect();
    // Joiners that start together do not all ask the same donor for the manifest first.
    donors.shuffle(&mut rand::thread_rng());
    donors.truncate(cfg.max_donors.max(1));
    let mut tally = Tally::default();
    tally.donors.resize(donors.len(), Default::default());
    let mut choice = choice;
    let got = fetch_manifest(node, cfg, layout, &mut choice, &donors, &mut tally).await?;
    let Some((manifest, spans, skip)) = got else {
        merge(report, &donors, &tally);
        let why = format!("no donor of epoch {} sent its manifest", choice.epoch);
        return Ok(Round::Failed {
            why,
            kept: carried,
            epoch: choice.epoch,
        });
    };
    let mut slots = carry_over(carried, &manifest);
    report.reused_chunks = slots.iter().filter(|s| s.is_some()).count();
    report.epoch = manifest.epoch;
    report.manifest_hash = choice.manifest_hash;
    report.chunks = spans.len();
    let expected: Vec<Expected> = spans
        .iter()
        .zip(&manifest.chunk_hashes)
        .map(|(s, h)| Expected {
            values: s.range.len(),
            hash: *h,
        })
        .collect();
    let limits = Limits {
        max_in_flight: cfg.max_in_flight,
        per_donor: cfg.per_donor_in_flight,
        busy_backoff: cfg.busy_backoff,
        max_busy: cfg.max_busy,
    };
    let hash = choice.manifest_hash;
    let fetch = |d: usize, c: usize| {
        let donor = &donors[d];
        fetch_chunk(node, cfg, donor, hash, c as u64, expected[c].values)
    };
    let plan = Plan {
        expected: &expected,
        donors: donors.len(),
        skip: &skip,
        limits,
        deadline,
    };
    let fetched = fetch_chunks(plan, &mut slots, fetch, &mut tally).await;
    merge(report, &donors, &tally);
    match fetched {
        Ok(()) => Ok(Round::Done(assemble(manifest, hash, spans, slots)?)),
        Err(Unfinished::Deadline) => Err(SyncError::Deadline(cfg.deadline)),
        Err(Unfinished::NoDonors) => {
            let missing = slots.iter().filter(|s| s.is_none()).count();
            let why = tally
                .donors
                .iter()
                .filter_map(|d| d.last_failure.clone())
                .next_back()
                .unwrap_or_else(|| format!("{missing} chunks missing, no donor left"));
            let epoch = manifest.epoch;
            Ok(Round::Failed {
                why,
                kept: Some((manifest, slots)),
                epoch,
            })
        }
    }
}

/// How often a sync waiting for donors to reach its `min_epoch` reads their announcements
/// again: a step can take well under `round_pause`, and a joiner that learns of the new state
/// late is an epoch behind again.
const ANNOUNCEMENT_POLL: Duration = Duration::from_millis(25);

/// Reads the announcements and picks the manifest (see [`choose_manifest`]); returns it and
/// the donors' addresses. While the donors of this model announce only epochs older than
/// `min_epoch` (they are still stepping towards it), reads again every [`ANNOUNCEMENT_POLL`]
/// until `deadline`.
async fn find_donors(
    node: &Node,
    cfg: &SyncConfig,
    layout: &StateLayout,
    deadline: Instant,
) -> Result<
    (
        ManifestChoice<PeerId>,
        std::collections::HashMap<PeerId, Vec<Multiaddr>>,
    ),
    SyncError,
> {
    let key = state_key(&cfg.run);
    let t = cfg.request_timeout;
    let me = node.peer_id();
    let (choice, announcements) = loop {
        let entries = timeout(t, node.get::<StateAnnouncement>(&key))
            .await
            .map_err(|_| SyncError::Timeout(t))??;
        let mut announcements: Vec<(PeerId, StateAnnouncement)> = entries
            .into_iter()
            .filter_map(|(subkey, a, _)| {
                let owner = starling_dht::required_owner(&key, &subkey).ok()??;
                let peer = starling_node::peer_id_of_owner(&owner)?;
                // A peer found down (crashed) cannot serve: asking it would cost a dial.
                (peer != me && !node.is_down(&peer)).then_some((peer, a))
            })
            .collect();
        if cfg.min_agreeing_donors <= 1 {
            served_now(node, cfg, layout.schema_hash(), &mut announcements).await;
        }
        let choice = choose_manifest(
            &announcements,
            layout.schema_hash(),
            cfg.min_epoch,
            cfg.min_agreeing_donors,
        );
        let newest = announcements
            .iter()
            .filter(|(_, a)| a.schema_hash == layout.schema_hash())
            .map(|(_, a)| a.epoch)
            .max();
        let stepping = newest.is_some_and(|e| e < cfg.min_epoch);
        if choice.is_some() || !stepping || Instant::now() + ANNOUNCEMENT_POLL >= deadline {
            break (choice, announcements);
        }
        tokio::time::sleep(ANNOUNCEMENT_POLL).await;
    };
    let Some(choice) = choice else {
        let seen: Vec<(u64, u64, String)> = announcements
            .iter()
            .map(|(_, a)| (a.epoch, a.schema_hash, short(&a.manifest_hash)))
            .collect();
        return Err(SyncError::NoDonors {
            run: cfg.run.clone(),
            schema_hash: layout.schema_hash(),
            min_epoch: cfg.min_epoch,
            min_agreeing: cfg.min_agreeing_donors,
            detail: format!("announcements (epoch, schema, manifest): {seen:x?}"),
        });
    };
    let addrs = announcements
        .into_iter()
        .map(|(peer, a)| (peer, announced_addrs(&a)))
        .collect();
    Ok((choice, addrs))
}

/// Donors whose hellos are asked what they serve now (see [`served_now`]): those with the
/// newest announcements.
const HELLO_CANDIDATES: usize = 8;

/// How long [`served_now`] waits for a hello (a few round trips, even over a slow link).
const HELLO_WAIT: Duration = Duration::from_secs(2);

/// Replaces what the donors of this model announced with what their hellos say they serve
/// now (for a sync that trusts one donor alone: a donor's hello is its own word over an
/// authenticated stream, as good as its signed DHT entry). Donors refresh their state at every
/// step but announce it at most every `announce_min_interval`
/// ([`StateServerConfig`](super::StateServerConfig)), so in a swarm stepping faster than that
/// the announcements lag: without this, a joiner could pick two donors still serving the last
/// epoch over a third already past it, sync a state the swarm had left, and sync again.
/// Asks the [`HELLO_CANDIDATES`] newest announcements at once; a donor that does not answer
/// within [`HELLO_WAIT`] (a crashed peer's announcement outlives it) keeps its announcement
/// (the rounds that follow deal with it).
async fn served_now(
    node: &Node,
    cfg: &SyncConfig,
    schema_hash: u64,
    announcements: &mut [(PeerId, StateAnnouncement)],
) {
    let mut ours: Vec<&mut (PeerId, StateAnnouncement)> = announcements
        .iter_mut()
        .filter(|(_, a)| a.schema_hash == schema_hash)
        .collect();
    ours.sort_by_key(|(_, a)| std::cmp::Reverse(a.epoch));
    ours.truncate(HELLO_CANDIDATES);
    let hellos = ours.iter().map(|(peer, a)| {
        let donor = Donor::new(*peer, announced_addrs(a));
        async move {
            let asked = timeout(
                HELLO_WAIT.min(cfg.request_timeout),
                open_new(node, cfg, &donor),
            );
            asked.await.ok()?.ok()
        }
    });
    let answers = futures::future::join_all(hellos).await;
    for ((_, a), answer) in ours.into_iter().zip(answers) {
        // (The stream is dropped: the round opens its own on the manifest it picks.)
        if let Some((_, epoch, manifest_hash)) = answer {
            a.epoch = epoch;
            a.manifest_hash = manifest_hash;
        }
    }
}

/// Gets the manifest from the first donor that sends the announced one (or, when one donor
/// is trusted alone, the newer one its hello names: `choice` is updated to it). Returns it, its
/// chunk places and the donors that failed; `None` when every donor failed.
async fn fetch_manifest(
    node: &Node,
    cfg: &SyncConfig,
    layout: &StateLayout,
    choice: &mut ManifestChoice<PeerId>,
    donors: &[Donor],
    tally: &mut Tally,
) -> Result<Option<(Manifest, Vec<ChunkSpan>, Vec<usize>)>, SyncError> {
    let mut failed = Vec::new();
    for (d, donor) in donors.iter().enumerate() {
        let announced = (choice.epoch, choice.manifest_hash);
        let got = timeout(cfg.request_timeout, async {
            let (mut stream, epoch, hash) = open_new(node, cfg, donor).await?;
            let wanted = if hash == announced.1 {
                announced
            } else if cfg.min_agreeing_donors <= 1 && epoch >= announced.0.max(cfg.min_epoch) {
                // It stepped since its announcement was read: its own word is what the DHT
                // entry would say (the entry is its signed copy of the same claim).
                tracing::debug!(peer = %donor.peer, epoch, "the donor serves a newer manifest than announced; taking it");
                (epoch, hash)
            } else {
                return Err((
                    Failure::Stale,
                    format!("serves epoch {epoch} ({}) now", short(&hash)),
                ));
            };
            let (tag, bytes) = exchange(&mut stream, &Request::Manifest, cfg.max_manifest_bytes)
                .await
                .map_err(frame_failure)?;
            if tag != TAG_MANIFEST {
                return Err(unexpected(tag, &bytes));
            }
            lock(&donor.idle).push(stream);
            donor.holds_manifest.store(true, Ordering::Relaxed);
            Ok((bytes, wanted))
        })
        .await
        .unwrap_or_else(|_| Err((Failure::Dead, "no manifest in time".into())));
        let checked = got.and_then(|(bytes, (epoch, hash))| {
            let max = cfg.max_chunk_elems;
            match Manifest::decode_checked(&bytes, &hash, epoch, layout, max) {
                Ok(m) => Ok(Ok((m, epoch, hash))),
                Err(ManifestFault::Layout(why)) => Ok(Err(why)),
                Err(ManifestFault::Donor(why)) => Err((Failure::Bad, why)),
            }
        });
        match checked {
            Ok(Ok(((manifest, spans), epoch, hash))) => {
                choice.epoch = epoch;
                choice.manifest_hash = hash;
                return Ok(Some((manifest, spans, failed)));
            }
            Ok(Err(why)) => return Err(SyncError::Layout(why)),
            Err((failure, why)) => {
                tracing::debug!(peer = %donor.peer, ?failure, "no manifest from donor: {why}");
                let t = &mut tally.donors[d];
                t.failures += 1;
                t.last_failure = Some(why);
                failed.push(d);
            }
        }
    }
    Ok(None)
}

/// An idle stream to `donor`, or a new one whose hello says it serves manifest `want`.
async fn open(
    node: &Node,
    cfg: &SyncConfig,
    donor: &Donor,
    want: &Digest,
) -> Result<Stream, Failed> {
    if let Some(stream) = lock(&donor.idle).pop() {
        return Ok(stream);
    }
    let (stream, epoch, manifest_hash) = open_new(node, cfg, donor).await?;
    if &manifest_hash == want {
        donor.holds_manifest.store(true, Ordering::Relaxed);
        return Ok(stream);
    }
    // Another stream of this round still holds `want` (the donor keeps it for that stream):
    // no more streams to this donor, but it is not stale.
    let failure = if donor.holds_manifest.load(Ordering::Relaxed) {
        Failure::Busy
    } else {
        Failure::Stale
    };
    Err((
        failure,
        format!("serves epoch {epoch} ({}) now", short(&manifest_hash)),
    ))
}

/// A new stream to `donor`, with the epoch and manifest its hello says the stream serves.
async fn open_new(
    node: &Node,
    cfg: &SyncConfig,
    donor: &Donor,
) -> Result<(Stream, u64, Digest), Failed> {
    let t = cfg.request_timeout;
    match timeout(t, node.connect_if_needed(donor.peer, &donor.addrs)).await {
        Ok(Err(NodeError::Closed)) => return Err((Failure::Dead, "our node stopped".into())),
        Err(_) => return Err((Failure::Dead, format!("no connection within {t:?}"))),
        // A failed dial is not final: libp2p may still reach the donor another way.
        Ok(_) => {}
    }
    let control = node.stream_control();
    let peer = donor.peer;
    let opened = open_confirmed(
        || {
            let mut control = control.clone();
            async move { control.open_stream(peer, PROTOCOL).await }
        },
        &Hello {
            version: WIRE_VERSION,
        },
        MAX_CONTROL_BYTES,
        Instant::now() + t,
        Retry {
            attempts: 4,
            pause: Duration::from_millis(25),
            ..Retry::default()
        },
    )
    .await
    .map_err(|e| match e {
        OpenError::BadReply(e) => (Failure::Bad, format!("bad hello reply: {e}")),
        other => (Failure::Dead, other.to_string()),
    })?;
    match opened.reply {
        HelloReply::Ready {
            epoch,
            manifest_hash,
        } => Ok((opened.stream, epoch, manifest_hash)),
        HelloReply::NoState => Err((Failure::Stale, "serves no state".into())),
        HelloReply::Busy => Err((Failure::Busy, "busy".into())),
        HelloReply::Unsupported { version } => {
            Err((Failure::Bad, format!("speaks wire version {version}")))
        }
    }
}

/// Sends a request and reads the one tagged frame that answers it (at most `max` bytes).
async fn exchange(
    stream: &mut Stream,
    request: &Request,
    max: usize,
) -> Result<(u8, Vec<u8>), FrameError> {
    write_msg(stream, request).await?;
    let mut buf = Vec::new();
    let (tag, _) = read_tagged_frame_into(stream, max.saturating_add(1), &mut buf).await?;
    Ok((tag, buf))
}

fn frame_failure(e: FrameError) -> Failed {
    match e {
        FrameError::Io(e) => (Failure::Dead, format!("stream failed: {e}")),
        other => (Failure::Bad, other.to_string()),
    }
}

/// A frame that is not the data asked for: a stale or error reply, or garbage.
fn unexpected(tag: u8, body: &[u8]) -> Failed {
    if tag != TAG_REPLY {
        return (Failure::Bad, format!("unexpected frame tag {tag}"));
    }
    match decode_msg::<Reply>(body) {
        Ok(Reply::Stale {
            now: Some((epoch, h)),
        }) => (
            Failure::Stale,
            format!("serves epoch {epoch} ({}) now", short(&h)),
        ),
        Ok(Reply::Stale { now: None }) => (Failure::Stale, "serves no state".into()),
        Ok(Reply::NoSuchChunk { index, chunks }) => (
            Failure::Bad,
            format!("has no chunk {index} (of {chunks}) in the announced manifest"),
        ),
        Err(e) => (Failure::Bad, format!("bad reply: {e}")),
    }
}

/// Requests chunk `index` (of `values` values) of manifest `hash` from `donor`; returns its
/// bytes unverified (the fetch loop verifies).
async fn fetch_chunk(
    node: &Node,
    cfg: &SyncConfig,
    donor: &Donor,
    hash: Digest,
    index: u64,
    values: usize,
) -> Result<Vec<u8>, Failed> {
    let mut stream = open(node, cfg, donor, &hash).await?;
    let request = Request::Chunk {
        manifest_hash: hash,
        index,
    };
    let max = values.saturating_mul(4).max(MAX_CONTROL_BYTES);
    let t = cfg.chunk_timeout;
    let (tag, bytes) = timeout(t, exchange(&mut stream, &request, max))
        .await
        .map_err(|_| (Failure::Dead, format!("no chunk within {t:?}")))?
        .map_err(frame_failure)?;
    if tag != TAG_CHUNK {
        return Err(unexpected(tag, &bytes));
    }
    lock(&donor.idle).push(stream);
    Ok(bytes)
}

/// Slots for `manifest`'s chunks, holding the chunks of the previous round's manifest that are
/// identical (same layout, chunk size, place and hash).
fn carry_over(previous: Option<Kept>, manifest: &Manifest) -> Vec<Option<Vec<f32>>> {
    let mut slots = vec![None; manifest.chunk_hashes.len()];
    let Some((old, old_slots)) = previous else {
        return slots;
    };
    if old.buffers != manifest.buffers || old.chunk_elems != manifest.chunk_elems {
        return slots;
    }
    for (i, value) in old_slots.into_iter().enumerate() {
        if old.chunk_hashes.get(i) == manifest.chunk_hashes.get(i) {
            if let Some(slot) = slots.get_mut(i) {
                *slot = value;
            }
        }
    }
    slots
}

/// Adds one round's per-donor tally to the report.
fn merge(report: &mut SyncReport, donors: &[Donor], tally: &Tally) {
    report.bytes += tally.bytes;
    report.retries += tally.retries;
    report.bad_chunks += tally.bad_chunks;
    report.busy += tally.busy;
    report.stale += tally.stale;
    report.peak_in_flight = report.peak_in_flight.max(tally.peak_in_flight);
    for (donor, t) in donors.iter().zip(&tally.donors) {
        let entry = match report.donors.iter_mut().position(|r| r.peer == donor.peer) {
            Some(i) => &mut report.donors[i],
            None => {
                report.donors.push(DonorReport {
                    peer: donor.peer,
                    chunks: 0,
                    bytes: 0,
                    bad_chunks: 0,
                    failures: 0,
                    last_failure: None,
                });
                let last = report.donors.len() - 1;
                &mut report.donors[last]
            }
        };
        entry.chunks += t.chunks;
        entry.bytes += t.bytes;
        entry.bad_chunks += t.bad_chunks;
        entry.failures += t.failures;
        if t.last_failure.is_some() {
            entry.last_failure = t.last_failure.clone();
        }
    }
}

/// The verified state, once every slot is filled.
fn assemble(
    manifest: Manifest,
    manifest_hash: Digest,
    spans: Vec<ChunkSpan>,
    slots: Vec<Option<Vec<f32>>>,
) -> Result<SyncedState, SyncError> {
    let total = slots.len();
    let Some(values) = slots.into_iter().collect::<Option<Vec<Vec<f32>>>>() else {
        return Err(SyncError::Incomplete {
            rounds: 0,
            missing: 1,
            chunks: total,
            last: "a chunk went missing after the fetch completed".into(),
            announced_epoch: Some(manifest.epoch),
        });
    };
    Ok(SyncedState {
        epoch: manifest.epoch,
        schema_hash: manifest.schema_hash,
        manifest_hash,
        buffers: manifest.buffers,
        counters: manifest.counters.into_iter().collect(),
        chunks: spans
            .into_iter()
            .zip(values)
            .map(|(s, v)| (s.buffer, s.range, v))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(hashes: &[u8], chunk_elems: u32) -> Manifest {
        Manifest {
            version: 1,
            epoch: 1,
            schema_hash: 0,
            chunk_elems,
            buffers: vec![("param".into(), hashes.len() as u64 * chunk_elems as u64)],
            counters: Vec::new(),
            chunk_hashes: hashes.iter().map(|&h| [h; 32]).collect(),
        }
    }

    #[test]
    fn only_identical_chunks_are_carried_into_the_next_manifest() {
        let old = manifest(&[1, 2, 3], 2);
        let slots = vec![Some(vec![1.0, 1.0]), None, Some(vec![3.0, 3.0])];
        let kept = carry_over(Some((old.clone(), slots.clone())), &manifest(&[1, 2, 9], 2));
        assert_eq!(kept, vec![Some(vec![1.0, 1.0]), None, None]);
        // Another chunk size: nothing is carried.
        let kept = carry_over(Some((old, slots)), &manifest(&[1, 2, 3], 3));
        assert!(kept.iter().all(Option::is_none));
        assert_eq!(carry_over(None, &manifest(&[1], 2)), vec![None]);
    }
}
