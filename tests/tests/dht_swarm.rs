//! Whole swarms on 127.0.0.1: replication, merge semantics, signatures, bad input.

use std::time::Duration;

use futures::stream::{self, StreamExt};
use starling_dht::{now_ms, DictionaryRecord, Entry, OwnerKey};
use starling_node::{cluster::LocalCluster, Node, NodeConfig, NodeError};
use starling_tests::{bounded, init_tracing};

fn cfg() -> NodeConfig {
    NodeConfig::default().with_request_timeout(Duration::from_secs(5))
}

/// Every peer reads every record: returns how many (peer, record) reads saw the right value.
async fn read_all(nodes: &[Node], n_records: usize) -> (usize, usize) {
    let jobs: Vec<(Node, usize)> = nodes
        .iter()
        .flat_map(|n| (0..n_records).map(move |i| (n.clone(), i)))
        .collect();
    let total = jobs.len();
    let ok = stream::iter(jobs)
        .map(|(node, i)| async move {
            let got: Vec<(String, u64, u64)> =
                node.get(&format!("rec.{i}")).await.unwrap_or_default();
            got.iter().any(|(_, v, _)| *v == i as u64)
        })
        .buffer_unordered(32)
        .filter(|ok| futures::future::ready(*ok))
        .count()
        .await;
    (ok, total)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_peers_all_records_everywhere_and_after_churn() {
    init_tracing();
    bounded(Duration::from_secs(240), async {
        let cluster = LocalCluster::start(32, cfg())
            .await
            .expect("cluster starts");
        let nodes = cluster.nodes;
        for (i, node) in nodes.iter().enumerate() {
            node.store(
                &format!("rec.{i}"),
                &node.peer_id().to_string(),
                &(i as u64),
                now_ms() + 300_000,
            )
            .await
            .expect("store succeeds");
        }
        let (ok, total) = read_all(&nodes, nodes.len()).await;
        assert_eq!(ok, total, "every peer reads every record");

        // Shut down 25% of the peers (including the bootstrap peer) after the stores.
        let (dead, alive) = nodes.split_at(8);
        futures::future::join_all(dead.iter().map(|n| n.shutdown())).await;
        let (ok, total) = read_all(alive, 32).await;
        assert_eq!(ok, total, "records survive the loss of 25% of peers");
        futures::future::join_all(alive.iter().map(|n| n.shutdown())).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subkeys_merge_latest_wins_and_entries_expire() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let cluster = LocalCluster::start(6, cfg()).await.unwrap();
        let n = &cluster.nodes;
        let now = now_ms();
        // Three writers, three sub-keys under one key: a reader sees all of them.
        n[1].store("group", "a", &1u32, now + 600_000)
            .await
            .unwrap();
        n[2].store("group", "b", &2u32, now + 600_000)
            .await
            .unwrap();
        n[3].store("group", "c", &3u32, now + 600_000)
            .await
            .unwrap();
        let mut got: Vec<(String, u32, u64)> = n[5].get("group").await.unwrap();
        got.sort();
        let pairs: Vec<(String, u32)> = got.into_iter().map(|(s, v, _)| (s, v)).collect();
        assert_eq!(
            pairs,
            vec![("a".into(), 1), ("b".into(), 2), ("c".into(), 3)]
        );

        // Latest expiration wins, whatever the order of writes.
        n[1].store("latest", "s", &10u32, now + 200_000)
            .await
            .unwrap();
        n[2].store("latest", "s", &20u32, now + 400_000)
            .await
            .unwrap();
        n[3].store("latest", "s", &30u32, now + 300_000)
            .await
            .unwrap();
        for reader in &n[..] {
            let got: Vec<(String, u32, u64)> = reader.get("latest").await.unwrap();
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].1, 20, "the entry with the latest expiration wins");
        }

        // A short-lived entry is returned before it expires and never after.
        let short_expiration = now_ms() + 5_000;
        n[4].store("short", "x", &7u32, short_expiration)
            .await
            .unwrap();
        n[4].store("short", "y", &8u32, now_ms() + 600_000)
            .await
            .unwrap();
        let got: Vec<(String, u32, u64)> = n[0].get("short").await.unwrap();
        assert_eq!(got.len(), 2);
        tokio::time::sleep(Duration::from_millis(
            short_expiration.saturating_sub(now_ms()) + 200,
        ))
        .await;
        for reader in &n[..] {
            let got: Vec<(String, u32, u64)> = reader.get("short").await.unwrap();
            assert_eq!(got.iter().map(|g| g.1).collect::<Vec<_>>(), vec![8]);
        }
        // Writing an already expired entry is refused locally with a clear error.
        let err = n[0]
            .store("short", "z", &1u32, now_ms() - 1)
            .await
            .unwrap_err();
        assert!(
            matches!(err, NodeError::Dht(starling_dht::DhtError::Expired { .. })),
            "{err}"
        );
        cluster.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_owner_entries_are_rejected_and_never_returned() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let cluster = LocalCluster::start(8, cfg()).await.unwrap();
        let n = &cluster.nodes;
        let (alice, mallory) = (&n[1], &n[2]);
        let key = "model.state";
        let subkey = alice.owner_marker();
        alice
            .store(key, &subkey, &"genuine".to_string(), now_ms() + 600_000)
            .await
            .unwrap();

        // Through the API, mallory cannot even try: the write is refused locally.
        let err = mallory
            .store(key, &subkey, &"forged".to_string(), now_ms() + 1_200_000)
            .await
            .unwrap_err();
        assert!(
            matches!(err, NodeError::Dht(starling_dht::DhtError::NotOwner(_))),
            "{err}"
        );

        // A raw forged record, signed by mallory's key, with a later expiration so it would win
        // the merge if accepted, and an unsigned one.
        let mallory_key = OwnerKey::from_secret_bytes(&[42; 32]);
        let value = starling_dht::encode_value(&"forged".to_string()).unwrap();
        let mut forged = Entry::new(subkey.clone(), value.clone(), now_ms() + 1_200_000);
        mallory_key.sign_entry(key, &mut forged);
        let unsigned = Entry::new(subkey.clone(), value, now_ms() + 1_300_000);
        let rejected_before: u64 = sum_rejected(n).await;
        for entry in [forged, unsigned] {
            let mut record = DictionaryRecord::default();
            record.insert(entry);
            let _ = mallory
                .send_raw_record_unchecked(key.as_bytes(), record.encode())
                .await;
        }
        let rejected_after = sum_rejected(n).await;
        assert!(
            rejected_after >= rejected_before + 2,
            "storing peers counted the rejections"
        );
        for reader in n {
            let got: Vec<(String, String, u64)> = reader.get(key).await.unwrap();
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].1, "genuine");
            let forged_value = starling_dht::encode_value(&"forged".to_string()).unwrap();
            let local = reader.get_local(key).await.unwrap();
            assert!(local.is_none_or(|r| r.get(&subkey).unwrap().value != forged_value));
        }
        // The owner can update its own entry.
        alice
            .store(key, &subkey, &"updated".to_string(), now_ms() + 900_000)
            .await
            .unwrap();
        let got: Vec<(String, String, u64)> = n[7].get(key).await.unwrap();
        assert_eq!(got[0].1, "updated");
        cluster.shutdown().await;
    })
    .await;
}

async fn sum_rejected(nodes: &[Node]) -> u64 {
    let mut total = 0;
    for n in nodes {
        total += n.status().await.unwrap().rejected_records;
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_records_are_rejected_without_panic() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let cluster = LocalCluster::start(5, cfg()).await.unwrap();
        let n = &cluster.nodes;
        let attacker = &n[4];
        let limits = starling_dht::DhtLimits::default();
        let mut big = DictionaryRecord::default();
        big.insert(Entry::new(
            "x",
            vec![7; limits.max_value_bytes + 1],
            now_ms() + 600_000,
        ));
        let mut far = DictionaryRecord::default();
        far.insert(Entry::new("x", vec![1], now_ms() + 10 * 24 * 3600 * 1000));
        let mut many = DictionaryRecord::default();
        for i in 0..limits.max_subkeys_per_key + 1 {
            many.insert(Entry::new(format!("s{i}"), vec![], now_ms() + 600_000));
        }
        let cases: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (b"garbage".to_vec(), vec![0xff; 100]),
            (b"empty".to_vec(), vec![]),
            (b"version".to_vec(), vec![99, 0]),
            (
                b"huge-length".to_vec(),
                vec![1, 0xff, 0xff, 0xff, 0xff, 0x0f],
            ),
            (vec![0xff, 0xfe], DictionaryRecord::default().encode()),
            (b"big-value".to_vec(), big.encode()),
            (b"far-future".to_vec(), far.encode()),
            (b"too-many-subkeys".to_vec(), many.encode()),
            (
                b"oversized-record".to_vec(),
                vec![1; limits.max_record_bytes + 1024],
            ),
            (
                vec![b'k'; limits.max_key_bytes + 1],
                DictionaryRecord::default().encode(),
            ),
        ];
        for (key, value) in cases {
            let _ = attacker.send_raw_record_unchecked(&key, value).await;
        }
        // Larger than a Kademlia packet: the frame itself is refused by the codec.
        let _ = attacker
            .send_raw_record_unchecked(b"beyond-packet", vec![0; limits.max_record_bytes * 4])
            .await;
        for node in &n[..4] {
            let status = node.status().await.unwrap();
            assert_eq!(status.records, 0, "nothing malformed was stored");
        }
        assert!(
            sum_rejected(&n[..4]).await >= 4 * 8,
            "each honest peer refused the bad records"
        );
        // The swarm still works.
        n[0].store("after", "ok", &1u8, now_ms() + 600_000)
            .await
            .unwrap();
        let got: Vec<(String, u8, u64)> = n[3].get("after").await.unwrap();
        assert_eq!(got.len(), 1);
        cluster.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_mode_peer_reads_and_writes_without_listening() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let cluster = LocalCluster::start(4, cfg()).await.unwrap();
        let boot = cluster.nodes[0].listen_addrs().await.unwrap()[0].clone();
        let client = Node::start(cfg().client(true).bootstrap_from(boot))
            .await
            .unwrap();
        assert!(client.listen_addrs().await.unwrap().is_empty());
        client
            .store("from-client", "c", &5u16, now_ms() + 600_000)
            .await
            .unwrap();
        let got: Vec<(String, u16, u64)> = cluster.nodes[3].get("from-client").await.unwrap();
        assert_eq!(got[0].1, 5);
        cluster.nodes[2]
            .store("to-client", "s", &6u16, now_ms() + 600_000)
            .await
            .unwrap();
        let got: Vec<(String, u16, u64)> = client.get("to-client").await.unwrap();
        assert_eq!(got[0].1, 6);
        // Servers do not put a client in their routing tables.
        for n in &cluster.nodes {
            assert!(n.status().await.unwrap().routing_table <= 3);
        }
        client.shutdown().await;
        cluster.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_failure_is_a_clear_error() {
    init_tracing();
    bounded(Duration::from_secs(30), async {
        // A port nothing listens on.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let mut cfg = cfg().bootstrap_from(format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap());
        cfg.bootstrap_attempts = 2;
        cfg.bootstrap_backoff = Duration::from_millis(100);
        let err = Node::start(cfg).await.unwrap_err();
        assert!(
            matches!(
                err,
                NodeError::Bootstrap {
                    tried: 1,
                    attempts: 2,
                    ..
                }
            ),
            "{err}"
        );
    })
    .await;
}

/// How many of `nodes` hold `key` in their own store.
async fn holders(nodes: &[Node], key: &str) -> usize {
    let held = futures::future::join_all(nodes.iter().map(|n| n.get_local(key))).await;
    held.into_iter()
        .filter(|r| matches!(r, Ok(Some(_))))
        .count()
}

/// With each record on 3 of 24 peers: `get_first` from a peer that lacks it finds it over the
/// network and answers nothing for a key nobody stored. Then 8 new peers join (they hold
/// nothing); for some keys a newcomer is now among the closest, and a latest `get` that finds
/// the record writes it back to it: over 16 keys, at least one gains a holder (8 did here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_first_finds_remote_records_and_latest_gets_cache_them() {
    init_tracing();
    bounded(Duration::from_secs(180), async {
        let mut c = cfg();
        c.replication_factor = 3;
        let cluster = LocalCluster::start(24, c.clone())
            .await
            .expect("cluster starts");
        let mut nodes = cluster.nodes;
        const KEYS: usize = 16;
        for i in 0..KEYS {
            let key = format!("cached.{i}");
            nodes[i]
                .store(&key, "v", &(i as u64), now_ms() + 300_000)
                .await
                .expect("store succeeds");
            // A reader that lacks it.
            let mut reader = None;
            for n in &nodes {
                if matches!(n.get_local(&key).await, Ok(None)) {
                    reader = Some(n.clone());
                    break;
                }
            }
            let reader = reader.expect("some peer lacks the record");
            let first: Vec<(String, u64, u64)> = reader.get_first(&key).await.unwrap();
            assert_eq!(first.len(), 1, "{key}: get_first");
            assert_eq!(first[0].1, i as u64);
        }
        let none: Vec<(String, u64, u64)> = nodes[5].get_first("nobody.stored.this").await.unwrap();
        assert!(none.is_empty());
        // Newcomers, bootstrapped from the first peer.
        let boot = nodes[0].listen_addrs().await.unwrap()[0].clone();
        for _ in 0..8 {
            let mut nc = c.clone();
            nc.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
            nodes.push(Node::start(nc.bootstrap_from(boot.clone())).await.unwrap());
        }
        let mut before = Vec::new();
        for i in 0..KEYS {
            before.push(holders(&nodes, &format!("cached.{i}")).await);
        }
        // With k = 3, a newcomer that is now among a key's 3 closest makes a lookup end without
        // the record (until it is republished): some of these gets find nothing, and only those
        // that found it write it back.
        for i in 0..KEYS {
            let latest: Vec<(String, u64, u64)> = nodes[(i + 7) % 24]
                .get(&format!("cached.{i}"))
                .await
                .unwrap();
            assert!(latest.len() <= 1, "cached.{i}: one sub-key");
        }
        // The write-backs are sent after the answers: wait for one (bounded).
        let mut gained = 0;
        for _ in 0..50 {
            gained = 0;
            for (i, b) in before.iter().enumerate() {
                if holders(&nodes, &format!("cached.{i}")).await > *b {
                    gained += 1;
                }
            }
            if gained > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!("{gained} of {KEYS} keys gained a holder through write-back");
        assert!(gained > 0, "no latest get wrote its record back");
        futures::future::join_all(nodes.iter().map(|n| n.shutdown())).await;
    })
    .await;
}

/// A peer that stops answering but keeps its connections open (a stalled process, a machine
/// swapping, a power cut before anyone noticed): its node runs on its own thread, which stops
/// polling it once it joined through `boot`. [`Stalled::release`] shuts it down.
async fn stalled_peer(c: &NodeConfig, boot: starling_node::Multiaddr) -> Stalled {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let (thaw_tx, thaw_rx) = std::sync::mpsc::channel::<()>();
    let mut sc = c.clone();
    sc.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    let sc = sc.bootstrap_from(boot);
    let stalled = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let node = rt.block_on(Node::start(sc)).expect("stalling peer starts");
        ready_tx.send(()).unwrap();
        // Not polled from here on: its sockets stay open, nothing answers.
        let _ = thaw_rx.recv();
        rt.block_on(node.shutdown());
    });
    tokio::task::spawn_blocking(move || ready_rx.recv())
        .await
        .unwrap()
        .expect("stalling peer joined");
    Stalled {
        thread: stalled,
        thaw: thaw_tx,
    }
}

/// A peer that stopped answering (see [`stalled_peer`]).
struct Stalled {
    thread: std::thread::JoinHandle<()>,
    thaw: std::sync::mpsc::Sender<()>,
}

impl Stalled {
    /// Lets it run again, shuts it down and waits for its thread.
    async fn release(self) {
        self.thaw.send(()).unwrap();
        let thread = self.thread;
        tokio::task::spawn_blocking(move || thread.join())
            .await
            .unwrap()
            .expect("stalled thread ends");
    }
}

/// A store whose closest peers include a stalled peer (see [`stalled_peer`]) cuts its lookup
/// at the budget (half the request timeout) and writes to the closest peers that answered,
/// instead of failing when the whole lookup times out; the other peers then read the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_succeeds_when_a_closest_peer_stops_answering() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let c = NodeConfig::default().with_request_timeout(Duration::from_secs(4));
        let cluster = LocalCluster::start(6, c.clone())
            .await
            .expect("cluster starts");
        let boot = cluster.nodes[0].listen_addrs().await.unwrap()[0].clone();
        // Its join connected it to everyone, who took it into their routing tables; it stopped
        // answering once joined.
        let stalled = stalled_peer(&c, boot).await;
        let started = std::time::Instant::now();
        for (i, n) in cluster.nodes.iter().enumerate() {
            let key = format!("stall.{i}");
            let stored = n.store(&key, "v", &(i as u64), now_ms() + 300_000).await;
            assert!(stored.is_ok(), "{key}: store failed: {stored:?}");
        }
        eprintln!(
            "{} stores past a stalled peer: {:.1} s",
            cluster.nodes.len(),
            started.elapsed().as_secs_f64()
        );
        for i in 0..cluster.nodes.len() {
            let reader = &cluster.nodes[(i + 1) % cluster.nodes.len()];
            let got: Vec<(String, u64, u64)> =
                reader.get_first(&format!("stall.{i}")).await.unwrap();
            assert_eq!(got.len(), 1, "stall.{i}: read back");
            assert_eq!(got[0].1, i as u64);
        }
        stalled.release().await;
        cluster.shutdown().await;
    })
    .await;
}

/// A latest get (what training's progress reads are) whose closest peers include a stalled
/// peer answers within the progress tracker's 5 s bound, with the node's default 10 s query
/// timeout: each Kademlia request to one peer gives up after `dht_peer_timeout` (3 s), so the
/// stalled peer costs one such wait, not the whole query (with a 10 s per-peer timeout, as
/// before, this test fails at its first get).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latest_get_does_not_wait_out_the_query_for_a_stalled_peer() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let c = NodeConfig::default();
        let cluster = LocalCluster::start(6, c.clone())
            .await
            .expect("cluster starts");
        for (i, n) in cluster.nodes.iter().enumerate() {
            n.store(&format!("frozen.{i}"), "v", &(i as u64), now_ms() + 300_000)
                .await
                .expect("stored");
        }
        let boot = cluster.nodes[0].listen_addrs().await.unwrap()[0].clone();
        let stalled = stalled_peer(&c, boot).await;
        for i in 0..cluster.nodes.len() {
            let reader = &cluster.nodes[(i + 1) % cluster.nodes.len()];
            let key = format!("frozen.{i}");
            let got = tokio::time::timeout(Duration::from_secs(5), reader.get::<u64>(&key))
                .await
                .unwrap_or_else(|_| panic!("{key}: the get waited out 5 s for the stalled peer"))
                .expect("get");
            assert_eq!(got.len(), 1, "{key}: read back");
            assert_eq!(got[0].1, i as u64);
        }
        stalled.release().await;
        cluster.shutdown().await;
    })
    .await;
}

/// A peer that left (its node gone) is dropped from the routing table at the first dial that
/// fails, so a survivor alone in the swarm reads and writes its own records at once instead of
/// dialling the dead peer again in every query. (libp2p-kad keeps a peer's last address after
/// failed dials; a QUIC dial to a peer that is gone fails only after the 5 s handshake timeout,
/// so every DHT call of a straggler whose swarm had left took 5 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_left_is_forgotten_and_a_survivor_alone_reads_its_own_records() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let listen = |n: NodeConfig| {
            n.listen_on("/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap())
                .listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap())
        };
        let gone = Node::start(listen(cfg())).await.unwrap();
        let mut survivor_cfg = listen(cfg());
        for a in gone.listen_addrs().await.unwrap() {
            survivor_cfg = survivor_cfg.bootstrap_from(a);
        }
        let survivor = Node::start(survivor_cfg).await.unwrap();
        survivor.bootstrap().await.unwrap();
        let key = "left.progress";
        survivor
            .store(key, "mine", &7u64, now_ms() + 300_000)
            .await
            .unwrap();
        assert_eq!(survivor.status().await.unwrap().routing_table, 1);
        gone.shutdown().await;
        // Reads go on answering with the local record while the dead peer is dialled, and the
        // failed dial takes it out of the table.
        let until = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let got: Vec<(String, u64, u64)> = survivor.get(key).await.unwrap();
            assert_eq!(got.len(), 1, "{got:?}");
            assert_eq!(got[0].1, 7);
            if survivor.status().await.unwrap().routing_table == 0 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "the peer that left is still in the routing table"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Alone now: a store has nobody to ask and keeps its record locally.
        let stored = survivor.store(key, "mine", &8u64, now_ms() + 300_000).await;
        assert!(
            matches!(stored, Ok(_) | Err(NodeError::QuorumFailed { .. })),
            "{stored:?}"
        );
        let got: Vec<(String, u64, u64)> = survivor.get(key).await.unwrap();
        assert_eq!(got[0].1, 8);
        survivor.shutdown().await;
    })
    .await;
}

/// A peer's inbound FindNode requests so far (libp2p-kad's own counter).
fn find_nodes_served(node: &Node) -> f64 {
    node.metrics()
        .encode()
        .lines()
        .find(|l| l.starts_with("libp2p_kad_inbound_requests_total{request=\"FindNode\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// A key written again soon goes straight to the closest peers its last lookup found: the
/// writes reach them (each holds the newest value) without another lookup; when one of those
/// peers has left, the write still reaches the others, and with none left it fails as it would
/// have after a lookup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_to_a_key_written_moments_ago_skip_the_lookup_and_survive_a_peer_leaving() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let cluster = LocalCluster::start(3, cfg()).await.expect("cluster starts");
        let nodes = cluster.nodes;
        let (writer, others) = (&nodes[0], &nodes[1..]);
        let me = writer.peer_id().to_string();
        let write = |v: u64| {
            let (writer, me) = (writer.clone(), me.clone());
            async move { writer.store("progress", &me, &v, now_ms() + 60_000).await }
        };
        // A write returns at its quorum (one peer): the other may store it a moment later.
        let holds = |node: &Node, want: u64| {
            let node = node.clone();
            async move {
                let give_up = tokio::time::Instant::now() + Duration::from_secs(2);
                loop {
                    let got: Option<DictionaryRecord> = node.get_local("progress").await.unwrap();
                    let value = got
                        .and_then(|r| r.entries().next().cloned())
                        .and_then(|e| starling_dht::decode_value::<u64>(&e.value).ok());
                    if value == Some(want) || tokio::time::Instant::now() > give_up {
                        return value == Some(want);
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        // The writer is the cluster's bootstrap node: the others reach its routing table as
        // their connections are identified, which can come after the cluster started (a first
        // write then found no peer: a CI flake).
        let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
        while writer.status().await.unwrap().routing_table < others.len() {
            assert!(
                tokio::time::Instant::now() < give_up,
                "the writer never knew both peers"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        write(0).await.expect("first write");
        let lookups_before: Vec<f64> = others.iter().map(find_nodes_served).collect();
        for v in 1..=5u64 {
            write(v).await.expect("write to kept peers");
            for (i, n) in others.iter().enumerate() {
                assert!(holds(n, v).await, "peer {i} lacks value {v}");
            }
        }
        let lookups_after: Vec<f64> = others.iter().map(find_nodes_served).collect();
        assert_eq!(
            lookups_before, lookups_after,
            "writes within the TTL looked the closest peers up again"
        );

        // One kept peer leaves: the next write still reaches the other.
        others[0].shutdown().await;
        write(6).await.expect("write with one kept peer gone");
        assert!(
            holds(&others[1], 6).await,
            "the remaining peer lacks value 6"
        );
        // The last one leaves: the write fails as after a lookup, with a clear error.
        others[1].shutdown().await;
        match write(7).await {
            Err(NodeError::QuorumFailed { .. }) => {}
            other => panic!("a write with every peer gone: {other:?}"),
        }
        writer.shutdown().await;
    })
    .await;
}
