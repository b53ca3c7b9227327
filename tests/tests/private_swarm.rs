//! A private swarm: only peers holding the swarm key can connect, read or write.

use std::time::Duration;

use starling_dht::now_ms;
use starling_node::{cluster::LocalCluster, Node, NodeConfig, NodeError, SwarmKey};
use starling_tests::{bounded, init_tracing};

fn cfg() -> NodeConfig {
    NodeConfig::default().with_request_timeout(Duration::from_secs(3))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outsiders_cannot_connect_read_or_write() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let key = SwarmKey::generate();
        let cluster = LocalCluster::start(4, cfg().with_swarm_key(key))
            .await
            .unwrap();
        cluster.nodes[1]
            .store("lab.secret", "s", &"inside".to_string(), now_ms() + 600_000)
            .await
            .unwrap();
        let mut targets = Vec::new();
        for n in &cluster.nodes {
            let addrs = n.listen_addrs().await.unwrap();
            assert!(!addrs.is_empty());
            for a in &addrs {
                assert!(
                    !a.to_string().contains("/udp/"),
                    "a private node listens on TCP only: {a}"
                );
            }
            targets.extend(addrs);
        }

        // A member with the key joins and reads.
        let member = Node::start(
            cfg()
                .with_swarm_key(key)
                .client(true)
                .bootstrap_from(targets[0].clone()),
        )
        .await
        .unwrap();
        let got: Vec<(String, String, u64)> = member.get("lab.secret").await.unwrap();
        assert_eq!(got[0].1, "inside");
        member.shutdown().await;

        // Outsiders: another key, and no key (a public node with TCP and QUIC).
        let other = Node::start(
            cfg()
                .with_swarm_key(SwarmKey::generate())
                .listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap()),
        )
        .await
        .unwrap();
        let public = Node::start(
            cfg()
                .listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap())
                .listen_on("/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap()),
        )
        .await
        .unwrap();
        for outsider in [&other, &public] {
            for addr in &targets {
                let r = outsider.dial(addr.clone()).await;
                assert!(r.is_err(), "outsider connected to {addr}");
            }
            // The same port over QUIC: nothing answers there either.
            let quic: starling_node::Multiaddr = targets[0]
                .to_string()
                .replace("/tcp/", "/udp/")
                .replacen("/p2p/", "/quic-v1/p2p/", 1)
                .parse()
                .unwrap();
            assert!(
                outsider.dial(quic).await.is_err(),
                "outsider connected over QUIC"
            );
            assert!(outsider.connected_peers().await.unwrap().is_empty());
            // It cannot write into or read from the private swarm.
            let _ = outsider
                .store("lab.secret", "x", &"outside".to_string(), now_ms() + 60_000)
                .await;
            let got: Vec<(String, String, u64)> =
                outsider.get("lab.secret").await.unwrap_or_default();
            assert!(
                got.iter().all(|g| g.1 != "inside"),
                "outsider read a private record"
            );
        }
        // Joining with a wrong key fails with the bootstrap error.
        let err = Node::start(
            cfg()
                .with_swarm_key(SwarmKey::generate())
                .client(true)
                .bootstrap_from(targets[0].clone()),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, NodeError::Bootstrap { .. }), "{err}");
        for n in &cluster.nodes {
            let got: Vec<(String, String, u64)> = n.get("lab.secret").await.unwrap();
            assert_eq!(got.len(), 1, "no outsider entry reached the swarm: {got:?}");
            assert!(n.status().await.unwrap().connected_peers <= 4);
        }
        other.shutdown().await;
        public.shutdown().await;
        cluster.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn private_nodes_refuse_quic() {
    let cfg = cfg()
        .with_swarm_key(SwarmKey::generate())
        .listen_on("/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap());
    let err = Node::start(cfg).await.unwrap_err();
    assert!(matches!(err, NodeError::Config(_)), "{err}");
}
