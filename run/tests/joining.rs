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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_started_before_the_creator_serves_waits_and_trains_with_it() {
    let hyper = Hyper {
        epochs: Some(EPOCHS),
        seed: Some(3),
        ..Hyper::default()
    };
    let mut m = new_manifest("early-joiner", "mlp", &hyper, DataSpec::Digits).unwrap();
    let digits = Arc::new(Dataset::Images(data::digits()));
    let rt = tokio::runtime::Handle::current();
    let cluster = LocalCluster::start(2, NodeConfig::default()).await.unwrap();
    let (creator, joiner) = (&cluster.nodes[0], &cluster.nodes[1]);
    m.schema_hash = model::schema_hex(&build_model(&m, &digits, None, rt.clone()).unwrap().params);
    let signed = SignedManifest::sign(&m, creator.owner_key()).unwrap();
    // The manifest is out (the joiner has it) before the creator's session starts.
    manifest::publish(creator, &m.name, &signed).await.unwrap();
    let session =
        |node: &starling_node::Node, sync_first: bool, seed: u64, kept: Arc<Kept>| Session {
            node: node.clone(),
            manifest: m.clone(),
            signed: signed.clone(),
            data: digits.clone(),
            built: build_model(&m, &digits, None, rt.clone()).unwrap(),
            checkpoint_dir: None,
            checkpoint_every: 10,
            sync_first,
            sample_seed: seed,
            stop: Arc::new(AtomicBool::new(false)),
            reporter: kept,
            progress_interval: Some(Duration::from_millis(25)),
            delayed_update: false,
            max_stale: None,
            attack: None,
        };
    let (kept_creator, kept_joiner) = (Arc::new(Kept::default()), Arc::new(Kept::default()));
    let early = tokio::spawn(session(joiner, true, 2, kept_joiner.clone()).run());
    // Long enough for the digits MLP to run all its epochs alone several times over.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let late = tokio::spawn(session(creator, false, 1, kept_creator.clone()).run());
    let (early, late) = (early.await.unwrap(), late.await.unwrap());
    cluster.shutdown().await;
    let (early, late) = (early.unwrap(), late.unwrap());
    assert!(early.finished && late.finished);

    let events = |kept: &Kept| kept.0.lock().unwrap().clone();
    let (joiner_events, creator_events) = (events(&kept_joiner), events(&kept_creator));
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
    let steps = |group: Option<usize>| {
        joiner_events
            .iter()
            .filter(|e| matches!(e, Event::Step { group_size, .. } if group.is_none() || *group_size == group))
            .count()
    };
    let (all, together) = (steps(None), steps(Some(2)));
    assert!(
        together + 2 >= all && together > 0,
        "the joiner averaged with the creator in {together} of its {all} steps"
    );
    let sha = |events: &[Event]| {
        events.iter().find_map(|e| match e {
            Event::Finished { params_sha256, .. } => Some(params_sha256.clone()),
            _ => None,
        })
    };
    assert_eq!(
        sha(&joiner_events),
        sha(&creator_events),
        "the two peers end with the same parameters"
    );
}
