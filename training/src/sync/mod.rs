//! State sync: a late joiner, or a peer that fell behind, downloads parameters, optimizer state
//! and epoch from live peers, and applies nothing until all of it is verified.
//!
//! - **Donors** ([`StateServer`]) capture their state at a step boundary ([`StateView`]: one
//!   copy), cut it into chunks of `chunk_elems` values, and announce the snapshot's epoch and
//!   manifest hash under `{run}.state` in an owner-signed DHT sub-key. They serve the manifest
//!   and chunks on [`PROTOCOL`], with bounded sessions in all and per peer, bounded frames and
//!   a timeout on every wait. A donor refreshed at every step ([`StateServer::refresh`])
//!   hashes a snapshot only when asked for it and announces at most every
//!   `announce_min_interval`, so its announcement can name an older epoch than it serves.
//! - **Joiners** ([`sync_state`]) read the announcements (trusting one donor alone, the
//!   default, they ask the newest few donors' hellos what each serves now and take that in
//!   place of its announcement), take the newest epoch's manifest that most donors announce
//!   ([`choose_manifest`]), fetch it and check its SHA-256 against the
//!   announced one (so every chunk hash in it is what the donors signed), check its layout
//!   against their own model and optimizers, then fetch the chunks from every donor that
//!   announced it in parallel: at most `max_in_flight` requests in all and `per_donor_in_flight`
//!   at one donor, the least-loaded donor first, so no donor is swamped (hivemind's
//!   `load_state_from_peers` downloads everything from one peer) and memory stays the
//!   destination buffers plus the chunks in transit. Every chunk's size and SHA-256 is checked;
//!   a donor that sends a bad chunk, dies, times out or moves on is asked nothing more and its
//!   chunks go to the others. When every donor of a manifest failed, the joiner reads the DHT
//!   again (up to `max_rounds`), keeping the verified chunks the new manifest shares.
//! - The result ([`SyncedState`]) is written only once complete, by [`StateTarget::apply`] or
//!   [`CollaborativeOptimizer::restore_from`](crate::CollaborativeOptimizer::restore_from), after
//!   its layout is checked again. The [`SyncReport`] says what came from whom.
//!
//! A donor keeps the snapshot a stream's hello announced for as long as that stream is open,
//! so a joiner's sessions finish the manifest they began on however often the donor steps.
//! When the DHT announced an older manifest than the donor's hello (it stepped since), a joiner
//! that trusts one donor (`min_agreeing_donors` 1) takes the hello's manifest, at `min_epoch`
//! or later, instead of giving up on that donor; one that asks for several agreeing donors
//! keeps to the agreed manifest, and a donor that moved on answers "stale" (the joiner then
//! starts over from the newer manifest, keeping chunks whose hash did not change).
//!
//! ```no_run
//! # async fn demo(donor: starling_node::Node, joiner: starling_node::Node) -> Result<(), Box<dyn std::error::Error>> {
//! use starling_training::sync::{sync_state, StateServer, StateServerConfig, StateTarget, StateView, SyncConfig};
//! use starling_training::{ParamSet, Sgd, SgdConfig};
//! let mut params = ParamSet::new();
//! params.add("w", &[4], &[0.1, 0.2, 0.3, 0.4])?;
//! let opt = Sgd::new(SgdConfig::new(0.1).momentum(0.9), params.len())?;
//! let server = StateServer::start(donor, StateServerConfig::new("my-run"))?;
//! server.update(StateView::new(3, &params).optimizer("opt", &opt).capture()?).await?;
//!
//! // On the joiner: the same model and optimizer, fresh.
//! let mut mine = ParamSet::new();
//! mine.add_zeros("w", &[4])?;
//! let mut my_opt = Sgd::new(SgdConfig::new(0.1).momentum(0.9), mine.len())?;
//! let layout = StateTarget::new(&mut mine).optimizer("opt", &mut my_opt).layout();
//! let (synced, report) = sync_state(&joiner, &SyncConfig::new("my-run"), &layout).await?;
//! let epoch = StateTarget::new(&mut mine).optimizer("opt", &mut my_opt).apply(&synced)?;
//! assert_eq!((epoch, mine.params()), (3, params.params()));
//! println!("{} bytes in {:.2} s, {} retries", report.bytes, report.seconds, report.retries);
//! # Ok(()) }
//! ```

mod client;
mod fetch;
mod manifest;
mod schedule;
mod server;
mod snapshot;
mod wire;

use std::time::Duration;

use starling_node::{NodeError, PeerId};

pub use client::sync_state;
pub use manifest::{
    choose_manifest, Digest, Manifest, ManifestChoice, StateAnnouncement, MANIFEST_VERSION,
};
pub use server::{ServeHold, Served, ServerStats, StateServer, HOLD_WAIT, RECENT_JOINERS};
pub use snapshot::{StateLayout, StateSnapshot, StateTarget, StateView, SyncedState, PARAM_BUFFER};
pub use wire::PROTOCOL;

/// Default chunk size: 256 Ki values, 1 MiB of `f32`.
pub const DEFAULT_CHUNK_ELEMS: usize = 256 * 1024;

/// The DHT key donors announce under.
///
/// ```
/// assert_eq!(starling_training::sync::state_key("my-run"), "my-run.state");
/// ```
pub fn state_key(run: &str) -> String {
    format!("{run}.state")
}

/// Why serving or syncing state failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// This peer's node failed (`Node(Closed)` when it stopped).
    #[error(transparent)]
    Node(#[from] NodeError),
    /// The DHT did not answer in time.
    #[error("the DHT did not answer within {0:?}")]
    Timeout(Duration),
    /// No donor announces a state this peer can take.
    #[error("no donor serves run {run:?} with this model (schema {schema_hash:016x}) at epoch {min_epoch} or later agreed by {min_agreeing} donors: {detail}")]
    NoDonors {
        /// The run.
        run: String,
        /// This model's schema hash.
        schema_hash: u64,
        /// The oldest epoch accepted.
        min_epoch: u64,
        /// Donors required to agree.
        min_agreeing: usize,
        /// What was found instead.
        detail: String,
    },
    /// The donors' state does not fit this peer's model or optimizers.
    #[error("the donors' state does not fit this model: {0}; register the same tensors and optimizers (same kind and options) as the swarm")]
    Layout(String),
    /// Every donor failed before every chunk arrived.
    #[error("state sync incomplete after {rounds} rounds: {missing} of {chunks} chunks missing; last failure: {last}")]
    Incomplete {
        /// Rounds tried.
        rounds: u32,
        /// Chunks not received.
        missing: usize,
        /// Chunks in all.
        chunks: usize,
        /// The last failure seen.
        last: String,
        /// The newest epoch of the state the donors announced, if a round found one: where
        /// the run is (a run whose peers all left still announces its last state for a while).
        announced_epoch: Option<u64>,
    },
    /// The sync ran past `SyncConfig::deadline`.
    #[error("state sync did not finish within {0:?}")]
    Deadline(Duration),
    /// Another state server serves this node already.
    #[error("a state server already serves this node; share it (StateServer is Clone)")]
    AlreadyServing,
    /// An invalid snapshot or configuration.
    #[error("invalid state or configuration: {0}")]
    Invalid(String),
    /// The server was shut down.
    #[error("the state server has stopped")]
    Stopped,
}

/// Everything tunable about a [`StateServer`].
///
/// ```
/// let mut cfg = starling_training::sync::StateServerConfig::new("my-run");
/// cfg.max_sessions = 8;
/// assert_eq!(cfg.chunk_elems, 256 * 1024);
/// ```
#[derive(Debug, Clone)]
pub struct StateServerConfig {
    /// The run; announcements go under `{run}.state`.
    pub run: String,
    /// Values per chunk (the transfer unit and the largest frame, 4 bytes a value).
    pub chunk_elems: usize,
    /// Streams served at once, in all; more are answered busy.
    pub max_sessions: usize,
    /// Streams served at once for one peer; more are answered busy.
    pub max_sessions_per_peer: usize,
    /// Bound on every read and write, and on a stream's idle time between requests.
    pub request_timeout: Duration,
    /// How long an announcement stays in the DHT.
    pub announce_ttl: Duration,
    /// How often the announcement is renewed (less than `announce_ttl`).
    pub announce_every: Duration,
    /// Least time between two announcements of refreshed states
    /// ([`StateServer::refresh`]): a swarm stepping faster announces its newest state this
    /// often instead of at every step (each announcement is a signed DHT store). Joiners that
    /// read an older announcement get the newest state from the donor's hello, unless they
    /// want `min_agreeing_donors` above 1 (then they wait for announcements that agree).
    pub announce_min_interval: Duration,
    /// Largest manifest this server will produce (joiners bound it too).
    pub max_manifest_bytes: usize,
    /// Fault injection for tests (`testing` feature only).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub faults: ServerFaults,
}

/// Faults a test donor can inject.
#[cfg(feature = "testing")]
#[doc(hidden)]
#[derive(Debug, Clone, Default)]
pub struct ServerFaults {
    /// Flip a bit in every chunk written.
    pub corrupt_chunks: bool,
    /// Serve this many chunk requests, then hang on every later one (see
    /// [`StateServer::hung`]).
    pub hang_after_chunks: Option<u64>,
}

impl StateServerConfig {
    /// Defaults: 1 MiB chunks, 32 streams in all and 4 per peer, 10 s request timeout,
    /// announcements that live 60 s renewed every 20 s and made at most every 250 ms,
    /// manifests up to 16 MiB (about half a million chunks).
    pub fn new(run: impl Into<String>) -> Self {
        StateServerConfig {
            run: run.into(),
            chunk_elems: DEFAULT_CHUNK_ELEMS,
            max_sessions: 32,
            max_sessions_per_peer: 4,
            request_timeout: Duration::from_secs(10),
            announce_ttl: Duration::from_secs(60),
            announce_every: Duration::from_secs(20),
            announce_min_interval: Duration::from_millis(250),
            max_manifest_bytes: 16 << 20,
            #[cfg(feature = "testing")]
            faults: ServerFaults::default(),
        }
    }

    fn validate(&self) -> Result<(), SyncError> {
        let bad = |what: &str| Err(SyncError::Invalid(what.to_string()));
        if self.chunk_elems == 0 || self.chunk_elems > MAX_CHUNK_ELEMS {
            return bad("chunk_elems must be 1 to 16 Mi values");
        }
        if self.max_sessions == 0 || self.max_sessions_per_peer == 0 {
            return bad("max_sessions and max_sessions_per_peer must be at least 1");
        }
        if self.announce_every.is_zero() || self.announce_every >= self.announce_ttl {
            return bad("announce_every must be above zero and below announce_ttl");
        }
        if self.announce_min_interval >= self.announce_every {
            return bad("announce_min_interval must be below announce_every");
        }
        Ok(())
    }
}

/// Largest chunk a server cuts: 16 Mi values (64 MiB frames).
const MAX_CHUNK_ELEMS: usize = 16 << 20;

/// Everything tunable about [`sync_state`].
///
/// ```
/// let mut cfg = starling_training::sync::SyncConfig::new("my-run");
/// cfg.min_agreeing_donors = 2; // trust a manifest only when two donors announce it
/// assert_eq!((cfg.max_in_flight, cfg.per_donor_in_flight), (8, 2));
/// ```
#[derive(Debug, Clone)]
pub struct SyncConfig {
    /// The run (announcements are read from `{run}.state`).
    pub run: String,
    /// Only states at this epoch or later are taken. While the donors of this model announce
    /// only older ones (they are still stepping towards it), the announcements are read again
    /// every 25 ms, up to `deadline`.
    pub min_epoch: u64,
    /// Donors that must announce the same manifest before it is taken.
    pub min_agreeing_donors: usize,
    /// Donors used at most (the first announcing the chosen manifest).
    pub max_donors: usize,
    /// Chunk requests in flight at once, in all (memory: this many chunks in transit).
    pub max_in_flight: usize,
    /// Chunk requests in flight at once at one donor (one stream each).
    pub per_donor_in_flight: usize,
    /// Bound on a DHT read, a connection, a stream's opening and the manifest's transfer.
    pub request_timeout: Duration,
    /// Bound on one chunk's request and transfer.
    pub chunk_timeout: Duration,
    /// Pause before asking a donor that answered busy again.
    pub busy_backoff: Duration,
    /// Busy answers after which a donor is left.
    pub max_busy: u32,
    /// Largest chunk accepted, in values.
    pub max_chunk_elems: usize,
    /// Largest manifest accepted, in bytes.
    pub max_manifest_bytes: usize,
    /// Times the DHT is read again when every donor of a manifest failed.
    pub max_rounds: u32,
    /// Pause between rounds (donors that moved on re-announce meanwhile).
    pub round_pause: Duration,
    /// Bound on the whole sync.
    pub deadline: Duration,
}

impl SyncConfig {
    /// Defaults: any epoch, one donor suffices, up to 16 donors, 8 requests in flight and 2 per
    /// donor, 10 s per request, 30 s per chunk, 3 rounds, 10 minutes in all.
    pub fn new(run: impl Into<String>) -> Self {
        SyncConfig {
            run: run.into(),
            min_epoch: 0,
            min_agreeing_donors: 1,
            max_donors: 16,
            max_in_flight: 8,
            per_donor_in_flight: 2,
            request_timeout: Duration::from_secs(10),
            chunk_timeout: Duration::from_secs(30),
            busy_backoff: Duration::from_millis(200),
            max_busy: 20,
            max_chunk_elems: MAX_CHUNK_ELEMS,
            max_manifest_bytes: 16 << 20,
            max_rounds: 3,
            round_pause: Duration::from_millis(500),
            deadline: Duration::from_secs(600),
        }
    }
}

/// What one donor contributed to a sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DonorReport {
    /// The donor.
    pub peer: PeerId,
    /// Verified chunks it sent.
    pub chunks: usize,
    /// Bytes of verified chunks it sent.
    pub bytes: u64,
    /// Chunks it sent whose size or hash was wrong (never applied).
    pub bad_chunks: usize,
    /// Requests to it that failed, bad chunks included.
    pub failures: usize,
    /// Its last failure.
    pub last_failure: Option<String>,
}

/// What a [`sync_state`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncReport {
    /// The epoch synced to.
    pub epoch: u64,
    /// SHA-256 of the manifest synced to.
    pub manifest_hash: Digest,
    /// Chunks in the state.
    pub chunks: usize,
    /// Chunks kept from an earlier round's manifest (same hash).
    pub reused_chunks: usize,
    /// Bytes of verified chunk data received.
    pub bytes: u64,
    /// Chunk requests repeated after a failure.
    pub retries: usize,
    /// Chunks received with a wrong size or hash (never applied).
    pub bad_chunks: usize,
    /// Busy answers.
    pub busy: usize,
    /// Stale answers (the donor had moved to another snapshot).
    pub stale: usize,
    /// Manifests tried (DHT reads).
    pub rounds: u32,
    /// Most chunk requests in flight at once.
    pub peak_in_flight: usize,
    /// Seconds the sync took.
    pub seconds: f64,
    /// Per donor, in the order they were used.
    pub donors: Vec<DonorReport>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults are valid; announcements renewed no less often than they are made, or
    /// made no less often than they expire, are refused with a message.
    #[test]
    fn server_configs_with_inverted_announcement_intervals_are_refused() {
        let ok = StateServerConfig::new("r");
        assert!(ok.validate().is_ok());
        let mut c = ok.clone();
        c.announce_min_interval = c.announce_every;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("announce_min_interval"), "{e}");
        let mut c = ok.clone();
        c.announce_every = c.announce_ttl;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("announce_every"), "{e}");
    }
}
