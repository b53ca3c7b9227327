//! A joiner that starts before the run's creator serves anything (peers started together, the
//! creator still building its model): it must wait for the run instead of training the run alone
//! from the initial values, which would take epochs nobody else took and leave the peers apart.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use starling_node::{cluster::LocalCluster, NodeConfig};
use starling_run::data::{self, Dataset};
use starling_run::manifest::{self, DataSpec, SignedManifest};
use starling_run::model;
use starling_run::setup::{build_model, new_manifest, Hyper};
use starling_run::{Event, Reporter, Session};

/// Keeps every event of one session.
#[derive(Default)]
struct Kept(Mutex<Vec<Event>>);

impl Reporter for Kept {
    fn event(&self, event: &Event) {
        self.0.lock().unwrap().push(event.clone());
    }
}

const EPOCHS: u64 = 30;

/// A fresh digits MLP run on `nodes` loopback nodes, its manifest published by the first.
struct Fixture {
    m: manifest::RunManifest,
    signed: SignedManifest,
    digits: Arc<Dataset>,
    rt: tokio::runtime::Handle,
    cluster: LocalCluster,
}

impl Fixture {
    async fn new(name: &str, nodes: usize) -> Fixture {
        let hyper = Hyper {
            epochs: Some(EPOCHS),
            seed: Some(3),
            ..Hyper::default()
        };
        let mut m = new_manifest(name, "mlp", &hyper, DataSpec::Digits).unwrap();
        let digits = Arc::new(Dataset::Images(data::digits()));
        let rt = tokio::runtime::Handle::current();
        let cluster = LocalCluster::start(nodes, NodeConfig::default())
            .await
            .unwrap();
        let creator = &cluster.nodes[0];
        m.schema_hash =
            model::schema_hex(&build_model(&m, &digits, None, rt.clone()).unwrap().params);
        let signed = SignedManifest::sign(&m, creator.owner_key()).unwrap();
        manifest::publish(creator, &m.name, &signed).await.unwrap();
        Fixture {
            m,
            signed,
            digits,
            rt,
            cluster,
        }
    }

    /// A session on node `i` (its events kept), syncing first if `sync_first`.
    fn session(&self, i: usize, sync_first: bool, min_peers: usize) -> (Session, Arc<Kept>) {
        let kept = Arc::new(Kept::default());
        let session = Session {
            node: self.cluster.nodes[i].clone(),
            manifest: self.m.clone(),
            signed: self.signed.clone(),
            data: self.digits.clone(),
            built: build_model(&self.m, &self.digits, None, self.rt.clone()).unwrap(),
            checkpoint_dir: None,
            checkpoint_every: 10,
            sync_first,
            sample_seed: 1 + i as u64,
            shard: None,
            stop: Arc::new(AtomicBool::new(false)),
            reporter: kept.clone(),
            progress_interval: Some(Duration::from_millis(25)),
            delayed_update: false,
            max_stale: None,
            attack: None,
            min_peers,
        };
        (session, kept)
    }
}

fn events(kept: &Kept) -> Vec<Event> {
    kept.0.lock().unwrap().clone()
}

/// A creator and a joiner of a fresh digits MLP run on two loopback nodes (the manifest
/// published before either session starts), the second session started `gap` after the first
/// (the joiner's first if `joiner_first`), both with `min_peers`: every event of each, the
/// creator's first.
async fn creator_and_joiner(
    name: &str,
    joiner_first: bool,
    gap: Duration,
    min_peers: usize,
) -> (Vec<Event>, Vec<Event>) {
    let fixture = Fixture::new(name, 2).await;
    let (creator_session, kept_creator) = fixture.session(0, false, min_peers);
    let (joiner_session, kept_joiner) = fixture.session(1, true, min_peers);
    let (first, second) = if joiner_first {
        (joiner_session, creator_session)
    } else {
        (creator_session, joiner_session)
    };
    let first = tokio::spawn(first.run());
    tokio::time::sleep(gap).await;
    let second = tokio::spawn(second.run());
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    fixture.cluster.shutdown().await;
    let (first, second) = (first.unwrap(), second.unwrap());
    assert!(first.finished && second.finished);
    (events(&kept_creator), events(&kept_joiner))
}

/// The parameters' digest a session ended with.
fn final_sha(events: &[Event]) -> Option<String> {
    events.iter().find_map(|e| match e {
        Event::Finished { params_sha256, .. } => Some(params_sha256.clone()),
        _ => None,
    })
}

/// Steps among `events` that averaged in a group of `group` (`None`: every step).
fn steps(events: &[Event], group: Option<usize>) -> usize {
    events
        .iter()
        .filter(|e| {
            matches!(e, Event::Step { group_size, .. } if group.is_none() || *group_size == group)
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_started_before_the_creator_serves_waits_and_trains_with_it() {
    // Long enough for the digits MLP to run all its epochs alone several times over.
    let (creator_events, joiner_events) =
        creator_and_joiner("early-joiner", true, Duration::from_secs(3), 0).await;
    // It synced from the creator (the creator may have stepped alone for the moment the
    // joiner took to notice it serving).
    let synced = joiner_events.iter().find_map(|e| match e {
        Event::Synced { epoch, .. } => Some(*epoch),
        _ => None,
    });
    assert!(
        synced.is_some_and(|e| e < EPOCHS / 2),
        "the joiner synced from the creator early in the run: {synced:?}"
    );
    // Every step the joiner took, it took with the creator (a failed round or two is allowed
    // for; a joiner that trained alone took none with it).
    let (all, together) = (steps(&joiner_events, None), steps(&joiner_events, Some(2)));
    assert!(
        together + 2 >= all && together > 0,
        "the joiner averaged with the creator in {together} of its {all} steps"
    );
    assert_eq!(
        final_sha(&joiner_events),
        final_sha(&creator_events),
        "the two peers end with the same parameters"
    );
}

/// `--min-peers 2` on both: the creator, started first, takes no step before the joiner is
/// in; the joiner syncs the initial state, every step of both is taken together, and the
/// first global batch is the target's size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_min_peers_the_creator_waits_for_the_joiner_before_its_first_batch() {
    let (creator_events, joiner_events) =
        creator_and_joiner("min-peers", false, Duration::from_secs(2), 2).await;
    let waits: Vec<(usize, usize)> = creator_events
        .iter()
        .filter_map(|e| match e {
            Event::Waiting { peers, wanted } => Some((*peers, *wanted)),
            _ => None,
        })
        .collect();
    assert_eq!(waits, [(1, 2), (2, 2)], "the creator's waiting events");
    assert!(
        joiner_events
            .iter()
            .any(|e| matches!(e, Event::Synced { epoch: 0, .. })),
        "the joiner synced the initial state: the creator had not stepped"
    );
    for (who, events) in [("creator", &creator_events), ("joiner", &joiner_events)] {
        let (all, together) = (steps(events, None), steps(events, Some(2)));
        assert!(
            together + 2 >= all && all as u64 >= EPOCHS - 2,
            "the {who} averaged with the other in {together} of its {all} steps"
        );
    }
    assert_eq!(final_sha(&joiner_events), final_sha(&creator_events));
    let first = |events: &[Event]| {
        events.iter().find_map(|e| match e {
            Event::Step { samples, .. } => Some(*samples),
            _ => None,
        })
    };
    // They began together (`start_together`): the first global batch is the target (the
    // MLP's default 256, in batches of 32), not each peer computing most of it (512 without).
    let (c, j) = (first(&creator_events), first(&joiner_events));
    let global = c.unwrap_or(0) + j.unwrap_or(0);
    assert!(
        (256..=256 + 32).contains(&global),
        "the first global batch: creator {c:?} + joiner {j:?} samples, for a target of 256"
    );
}

/// A joiner that arrives after the run ended (its peers finished and left; their state
/// announcements outlive them in the DHT for a while) is told so and trains nothing: training
/// the whole run alone from the initial values ended, in an eight-process run whose last joiner
/// started late, with a model nobody else had, reported as if it had joined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_of_a_run_that_has_ended_is_told_so_and_trains_nothing() {
    // Node 1 only holds the DHT records: the run's announcements stay there once node 0 left.
    let fixture = Fixture::new("ended-run", 3).await;
    let (creator, kept_creator) = fixture.session(0, false, 0);
    let outcome = creator.run().await.unwrap();
    assert!(outcome.finished);
    assert!(final_sha(&events(&kept_creator)).is_some());
    fixture.cluster.nodes[0].shutdown().await;

    let (late, kept_late) = fixture.session(2, true, 0);
    let started = std::time::Instant::now();
    let err = late
        .run()
        .await
        .expect_err("a joiner of an ended run trained");
    let text = format!("{err:#}");
    assert!(text.contains("has ended"), "{text}");
    assert!(text.contains(&format!("of {EPOCHS}")), "{text}");
    let late_events = events(&kept_late);
    assert_eq!(steps(&late_events, None), 0, "{late_events:?}");
    eprintln!("told after {:?}: {text}", started.elapsed());
    fixture.cluster.shutdown().await;
}
