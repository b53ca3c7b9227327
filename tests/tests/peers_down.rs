//! A peer whose process dies (SIGKILL: no goodbye, sockets closed by the kernel) is found down
//! by the peers it was connected to (so is one that leaves), and their dials, lookups and reachability checks stop
//! waiting for it (see `starling_node::DownPeers`).

use std::time::Duration;

use starling_dht::now_ms;
use starling_node::{Keypair, Multiaddr, Node, NodeConfig, PeerId};
use starling_tests::{bounded, init_tracing};

/// TCP and QUIC on 127.0.0.1, as `starling train` listens by default (QUIC is the transport
/// whose dials to a dead peer can only time out).
fn cfg() -> NodeConfig {
    NodeConfig::default()
        .with_request_timeout(Duration::from_secs(5))
        .listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap())
        .listen_on("/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap())
}

/// A peer on its own thread and runtime; [`Doomed::kill`] drops the runtime without shutting
/// the node down, which closes its sockets the way the kernel does for a killed process.
struct Doomed {
    peer: PeerId,
    addrs: Vec<Multiaddr>,
    kill: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Doomed {
    async fn start(cfg: NodeConfig) -> Doomed {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (kill, kill_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let node = rt.block_on(Node::start(cfg)).expect("doomed peer starts");
            let addrs = rt.block_on(node.listen_addrs()).unwrap();
            ready_tx.send((node.peer_id(), addrs)).unwrap();
            let _ = kill_rx.recv();
            // No shutdown: the runtime and every socket go at once.
            rt.shutdown_background();
        });
        let (peer, addrs) = tokio::task::spawn_blocking(move || ready_rx.recv())
            .await
            .unwrap()
            .expect("doomed peer ready");
        Doomed {
            peer,
            addrs,
            kill,
            thread,
        }
    }

    async fn kill(self) {
        self.kill.send(()).unwrap();
        tokio::task::spawn_blocking(move || self.thread.join())
            .await
            .unwrap()
            .unwrap();
    }
}

/// Polls `cond` every 50 ms until it holds, or fails with `what` after `limit`.
async fn until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let end = tokio::time::Instant::now() + limit;
    while !cond() {
        assert!(tokio::time::Instant::now() < end, "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_is_found_down_its_dials_fail_at_once_and_a_restart_clears_it() {
    init_tracing();
    bounded(Duration::from_secs(120), async {
        let survivor = Node::start(cfg()).await.unwrap();
        let boot = survivor.listen_addrs().await.unwrap();
        let mut joiner_cfg = cfg();
        for a in &boot {
            joiner_cfg = joiner_cfg.bootstrap_from(a.clone());
        }
        let key = Keypair::generate_ed25519();
        let doomed = Doomed::start(joiner_cfg.clone().with_identity(key.clone())).await;
        let alive = Node::start(joiner_cfg.clone()).await.unwrap();
        alive.bootstrap().await.unwrap();
        survivor.bootstrap().await.unwrap();
        let (dead, dead_addrs) = (doomed.peer, doomed.addrs.clone());
        assert!(survivor.connected_peers().await.unwrap().contains(&dead));
        survivor
            .store("crash.progress", "mine", &1u64, now_ms() + 60_000)
            .await
            .unwrap();
        assert!(survivor.peers_down().is_empty());

        doomed.kill().await;
        until(
            Duration::from_secs(20),
            "the killed peer was never found down",
            || survivor.is_down(&dead),
        )
        .await;
        assert_eq!(survivor.peers_down(), vec![dead]);
        assert!(
            !survivor.is_down(&alive.peer_id()),
            "a live peer was marked down"
        );
        // Every address, QUIC included, is refused at once instead of timing out.
        let quic = dead_addrs
            .iter()
            .find(|a| a.to_string().contains("quic"))
            .expect("a QUIC address")
            .clone();
        let dialed = tokio::time::timeout(Duration::from_secs(2), survivor.dial(quic))
            .await
            .expect("a dial to a down peer waited");
        let err = dialed.expect_err("dialed a dead peer");
        assert!(err.to_string().contains("down"), "{err}");
        let reachable = tokio::time::timeout(
            Duration::from_secs(2),
            survivor.connect_if_needed(dead, &dead_addrs),
        )
        .await
        .expect("a reachability check of a down peer waited");
        assert!(!reachable.unwrap());
        // Out of the routing table; the DHT still answers from the live peers.
        assert_eq!(survivor.status().await.unwrap().routing_table, 1);
        let got: Vec<(String, u64, u64)> = alive.get("crash.progress").await.unwrap();
        assert_eq!(got.len(), 1);

        // The peer restarts with its identity and joins through the survivor: not down there.
        let back = Node::start(joiner_cfg.with_identity(key)).await.unwrap();
        assert_eq!(back.peer_id(), dead);
        until(
            Duration::from_secs(20),
            "the restarted peer is still marked down",
            || !survivor.is_down(&dead),
        )
        .await;
        // A peer that leaves properly is down as well once its connections close (nothing
        // listens where it did): the others stop dialing it too.
        let left = alive.peer_id();
        alive.shutdown().await;
        until(
            Duration::from_secs(20),
            "a peer that left was never found down",
            || survivor.is_down(&left),
        )
        .await;
        assert!(!survivor.is_down(&dead));
        back.shutdown().await;
        survivor.shutdown().await;
    })
    .await;
}
