//! The connection manager on real nodes (127.0.0.1): over the high-water mark a node closes
//! connections down to its low-water mark, keeps the peers it exchanges streams with, and the
//! DHT still answers everywhere; the ceiling on established connections holds.

use std::time::Duration;

use futures::StreamExt;
use starling_dht::now_ms;
use starling_node::{cluster::LocalCluster, ConnectionLimits, Node, NodeConfig, StreamProtocol};
use starling_tests::{bounded, init_tracing};

const PING: StreamProtocol = StreamProtocol::new("/starling-test/ping/1");

fn limits(low: usize, high: usize, grace: Duration) -> ConnectionLimits {
    ConnectionLimits {
        low_water: low,
        high_water: high,
        grace,
        max_established: None,
    }
}

/// The number in a counter's exposition line `name value`.
fn counter(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_high_water_mark_the_least_used_go_and_the_dht_still_answers() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let cfg = NodeConfig::default()
            .with_request_timeout(Duration::from_secs(5))
            .with_connections(limits(3, 6, Duration::from_secs(1)));
        // 16 peers, each refreshing its routing table once all have joined: about everyone
        // connects to everyone (15 each), far over the high-water mark of 6.
        let cluster = LocalCluster::start(16, cfg).await.expect("cluster starts");
        let nodes = cluster.nodes;
        let hub = nodes[0].clone();
        let user = nodes[5].clone();

        // The hub serves a ping protocol; `user` pings it every 200 ms: a peer in use.
        let mut incoming = hub.stream_control().accept(PING).expect("accept");
        let serve = tokio::spawn(async move {
            while let Some((_peer, stream)) = incoming.next().await {
                drop(stream);
            }
        });
        let hub_id = hub.peer_id();
        let pinger = {
            let user = user.clone();
            tokio::spawn(async move {
                let mut control = user.stream_control();
                loop {
                    let _ = control.open_stream(hub_id, PING).await;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        };

        // The sweep (every 5 s) prunes what connection events did not: wait for every node to
        // be at or under its high-water mark.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let counts = loop {
            let counts: Vec<usize> = futures::future::join_all(
                nodes
                    .iter()
                    .map(|n| async move { n.connected_peers().await.unwrap().len() }),
            )
            .await;
            if counts.iter().all(|c| *c <= 6) || tokio::time::Instant::now() > deadline {
                break counts;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        assert!(
            counts.iter().all(|c| *c <= 6),
            "connections per node: {counts:?}"
        );
        let pruned: u64 = nodes
            .iter()
            .map(|n| {
                counter(
                    &n.metrics().encode(),
                    "starling_node_connections_pruned_total",
                )
            })
            .sum();
        assert!(pruned > 0, "the manager pruned nothing: {counts:?}");
        assert!(
            hub.connected_peers()
                .await
                .unwrap()
                .contains(&user.peer_id()),
            "the peer that keeps opening streams to the hub was pruned"
        );

        // The DHT answers from every peer although most connections are gone.
        nodes[3]
            .store("pruned.rec", "k", &42u64, now_ms() + 60_000)
            .await
            .expect("store");
        for (i, n) in nodes.iter().enumerate() {
            let got: Vec<(String, u64, u64)> = n.get("pruned.rec").await.expect("get");
            assert!(
                got.iter().any(|(_, v, _)| *v == 42),
                "peer {i} does not read the record"
            );
        }
        pinger.abort();
        serve.abort();
        futures::future::join_all(nodes.iter().map(|n| n.shutdown())).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_more_connections_than_the_ceiling_are_ever_established() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let listen: starling_node::Multiaddr = "/ip4/127.0.0.1/tcp/0".parse().unwrap();
        let hub = Node::start(
            NodeConfig::default()
                .listen_on(listen.clone())
                .with_connections(ConnectionLimits {
                    max_established: Some(3),
                    ..ConnectionLimits::unlimited()
                }),
        )
        .await
        .expect("hub starts");
        let addr = hub.listen_addrs().await.unwrap()[0].clone();
        let mut peers = Vec::new();
        for _ in 0..6 {
            peers.push(
                Node::start(
                    NodeConfig::default()
                        .listen_on(listen.clone())
                        .with_request_timeout(Duration::from_secs(2)),
                )
                .await
                .expect("peer starts"),
            );
        }
        let sampler = {
            let hub = hub.clone();
            tokio::spawn(async move {
                let mut most = 0;
                for _ in 0..40 {
                    most = most.max(hub.connected_peers().await.map_or(0, |c| c.len()));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                most
            })
        };
        let dials = futures::future::join_all(peers.iter().map(|p| p.dial(addr.clone()))).await;
        let most = sampler.await.unwrap();
        assert!(
            most <= 3,
            "the hub held {most} connections, over its ceiling of 3"
        );
        let held = hub.connected_peers().await.unwrap().len();
        assert!(held >= 1, "the ceiling let no one in ({dials:?})");
        futures::future::join_all(peers.iter().map(|n| n.shutdown())).await;
        hub.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_next_to_peers_at_their_ceiling_succeeds_and_its_bootstrap_counts_the_refusals() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let listen: starling_node::Multiaddr = "/ip4/127.0.0.1/tcp/0".parse().unwrap();
        let base = NodeConfig::default()
            .listen_on(listen.clone())
            .with_request_timeout(Duration::from_secs(2));
        let hub = Node::start(base.clone()).await.expect("hub starts");
        let addr = hub.listen_addrs().await.unwrap()[0].clone();
        // Two peers that hold one connection at most: the one to the hub. They refuse anyone
        // else, as busy peers at their ceiling do.
        let mut full = Vec::new();
        for _ in 0..2 {
            full.push(
                Node::start(
                    base.clone()
                        .with_connections(ConnectionLimits {
                            max_established: Some(1),
                            ..ConnectionLimits::unlimited()
                        })
                        .bootstrap_from(addr.clone()),
                )
                .await
                .expect("a full peer starts"),
            );
        }
        // The hub names them to a newcomer, whose join still succeeds (it is connected to the
        // hub), after retrying its lookup with a short backoff.
        let mut cfg = base.clone().bootstrap_from(addr.clone());
        cfg.bootstrap_attempts = 2;
        cfg.bootstrap_backoff = Duration::from_millis(100);
        let newcomer = Node::start(cfg).await.expect("the join succeeds");
        let report = newcomer.bootstrap().await.expect("bootstrap answers");
        assert!(
            report.failed >= 1 && report.answered >= 1,
            "the hub answered and the full peers refused: {report:?}"
        );
        assert_eq!(
            report.routing_table, 1,
            "only the hub is in the table: {report:?}"
        );
        // Once a full peer has room, a lookup finds it.
        full.pop().unwrap().shutdown().await;
        let other = Node::start(base.clone().bootstrap_from(addr.clone()))
            .await
            .expect("a peer with room joins");
        let report = newcomer.bootstrap().await.expect("bootstrap answers");
        assert!(
            report.routing_table >= 2,
            "{report:?} ({})",
            other.peer_id()
        );
        for n in full.iter().chain([&other, &newcomer, &hub]) {
            n.shutdown().await;
        }
    })
    .await;
}
