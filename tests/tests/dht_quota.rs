//! Per-writer DHT quotas on a whole swarm (issue #11, item 3): a peer that floods one key with
//! unsigned sub-keys and a peer that stores until its byte quota are both refused past their
//! quotas on every storing peer, while other writers' records, matchmaking and averaging keep
//! working and no store grows past its stated bound.

use std::time::{Duration, Instant};

use futures::future::join_all;
use starling_averager::{Averager, AveragerConfig};
use starling_dht::{now_ms, DhtLimits, DictionaryRecord, Entry};
use starling_node::{cluster::LocalCluster, Node, NodeConfig};
use starling_tests::{bounded, init_tracing, normal_vec, rel_error};

/// Honest peers (they average together); the next two are the flooders.
const HONEST: usize = 4;
/// Sub-keys the squatter tries to put under one key: all of `max_subkeys_per_key`.
const SQUAT_SUBKEYS: usize = 1024;
/// Sub-keys per record the squatter sends.
const SQUAT_BATCH: usize = 16;
/// Records (one key each) and value size the byte flooder sends: together more than the
/// whole store may hold.
const FILL_RECORDS: usize = 200;
const FILL_VALUE: usize = 4096;

/// Small quotas so the floods reach them quickly; `max_total_bytes` is below what the byte
/// flood alone sends, so without a per-writer quota it would fill every store it reaches.
fn limits() -> DhtLimits {
    DhtLimits {
        max_subkeys_per_writer_per_key: SQUAT_BATCH,
        max_bytes_per_writer: 64 * 1024,
        max_total_bytes: 512 * 1024,
        ..DhtLimits::default()
    }
}

fn squat_record(batch: usize) -> Vec<u8> {
    let mut r = DictionaryRecord::default();
    for i in batch * SQUAT_BATCH..(batch + 1) * SQUAT_BATCH {
        r.insert(Entry::new(
            format!("junk{i}"),
            vec![1; 8],
            now_ms() + 600_000,
        ));
    }
    r.encode()
}

fn fill_record() -> Vec<u8> {
    let mut r = DictionaryRecord::default();
    r.insert(Entry::new("", vec![2; FILL_VALUE], now_ms() + 600_000));
    r.encode()
}

async fn sum_rejected(nodes: &[Node]) -> u64 {
    let mut total = 0;
    for n in nodes {
        total += n.status().await.unwrap().rejected_records;
    }
    total
}

/// What `node` holds from the two flooders: the squatter's sub-keys under `squat`, and the
/// encoded bytes of the byte flooder's entries.
async fn held_from_flooders(node: &Node) -> (usize, usize) {
    let squatted = node.get_local("squat").await.unwrap().map_or(0, |r| {
        r.entries().filter(|e| e.subkey.starts_with("junk")).count()
    });
    let mut filled = 0;
    for i in 0..FILL_RECORDS {
        if let Some(r) = node.get_local(&format!("fill.{i}")).await.unwrap() {
            filled += r.entries().map(Entry::encoded_len).sum::<usize>();
        }
    }
    (squatted, filled)
}

/// Checks every peer against the quotas and the total bound of `limits()`.
async fn check_bounds(nodes: &[Node]) {
    let l = limits();
    for (i, node) in nodes.iter().enumerate() {
        let (squatted, filled) = held_from_flooders(node).await;
        assert!(
            squatted <= l.max_subkeys_per_writer_per_key,
            "peer {i} holds {squatted} squatted sub-keys"
        );
        assert!(
            filled <= l.max_bytes_per_writer,
            "peer {i} holds {filled} flooded bytes"
        );
        let status = node.status().await.unwrap();
        assert!(
            status.record_bytes <= l.max_total_bytes,
            "peer {i} holds {} bytes, over the bound {}",
            status.record_bytes,
            l.max_total_bytes
        );
    }
}

/// The honest peers average once, in one group; each ends with the exact mean.
async fn average_once(nodes: &[Node]) {
    let mut averagers = Vec::new();
    for n in nodes {
        let mut cfg = AveragerConfig::new("quota");
        cfg.target_group_size = nodes.len();
        cfg.min_group_size = 2;
        cfg.matchmaking_time = Duration::from_secs(8);
        averagers.push(Averager::new(n.clone(), cfg).await.unwrap());
    }
    let mut tensors: Vec<Vec<f32>> = (0..nodes.len())
        .map(|p| normal_vec(1000, p as u64 + 1))
        .collect();
    let mean: Vec<f32> = (0..1000)
        .map(|k| tensors.iter().map(|t| t[k]).sum::<f32>() / nodes.len() as f32)
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let rounds = averagers
        .iter()
        .zip(tensors.iter_mut())
        .map(|(a, t)| async move {
            let mut views: Vec<&mut [f32]> = vec![&mut t[..]];
            a.step(&mut views, 1.0, deadline).await
        });
    for (p, report) in join_all(rounds).await.into_iter().enumerate() {
        let report = report.expect("round succeeds");
        assert_eq!(
            report.group.len(),
            nodes.len(),
            "peer {p} was in the full group"
        );
        assert_eq!(report.averaged_fraction(), 1.0);
    }
    for t in &tensors {
        assert!(rel_error(t, &mean) < 1e-5);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flooders_are_refused_past_their_quotas_and_the_swarm_keeps_working() {
    init_tracing();
    bounded(Duration::from_secs(180), async {
        let cfg = NodeConfig::default()
            .with_request_timeout(Duration::from_secs(5))
            .with_dht_limits(limits());
        let cluster = LocalCluster::start(HONEST + 2, cfg).await.unwrap();
        let nodes = &cluster.nodes;
        let (squatter, filler) = (&nodes[HONEST], &nodes[HONEST + 1]);

        // Both floods bypass local validation and go to every peer the flooder reaches.
        let squat = async {
            for batch in 0..SQUAT_SUBKEYS / SQUAT_BATCH {
                let _ = squatter
                    .send_raw_record_unchecked(b"squat", squat_record(batch))
                    .await;
            }
        };
        let fill = async {
            for i in 0..FILL_RECORDS {
                let _ = filler
                    .send_raw_record_unchecked(format!("fill.{i}").as_bytes(), fill_record())
                    .await;
            }
        };
        futures::join!(squat, fill);
        assert!(FILL_RECORDS * FILL_VALUE > limits().max_total_bytes);

        // Every flood record was acknowledged by at least one peer, which has then seen it. A
        // peer takes at most one squat batch and `max_bytes_per_writer / FILL_VALUE` fill
        // records, so at least this many were refused somewhere: wait for the counters.
        let per_peer_fill = limits().max_bytes_per_writer / FILL_VALUE;
        let at_least = (SQUAT_SUBKEYS / SQUAT_BATCH - (HONEST + 1))
            + (FILL_RECORDS - (HONEST + 1) * per_peer_fill);
        while sum_rejected(nodes).await < at_least as u64 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        check_bounds(nodes).await;

        // Other writers still write under the squatted key and elsewhere.
        nodes[1]
            .store("squat", "honest", &7u32, now_ms() + 600_000)
            .await
            .expect("an honest sub-key fits under the squatted key");
        nodes[0]
            .store("after", "ok", &1u8, now_ms() + 600_000)
            .await
            .expect("honest stores still fit");
        let got: Vec<(String, u32, u64)> = nodes[2].get("squat").await.unwrap();
        assert!(got.iter().any(|(s, v, _)| s == "honest" && *v == 7));
        let got: Vec<(String, u8, u64)> = nodes[3].get("after").await.unwrap();
        assert_eq!(got.len(), 1);

        // Matchmaking (owner-signed declarations) and a whole averaging round still work.
        average_once(&nodes[..HONEST]).await;
        check_bounds(nodes).await;
        cluster.shutdown().await;
    })
    .await;
}
