//! The swarm task and fast lane log inside the node span; a listen that fails says why; shutdown
//! returns once the node is closed.

use super::*;
use std::sync::Mutex;

/// Collects what a fmt subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        starling_dht::lock::lock(&self.0).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn the_swarm_task_and_the_fast_lane_log_inside_the_node_span() {
    let out = Captured::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    // A current-thread runtime: the node's tasks run on this thread, under this subscriber.
    let _guard = tracing::subscriber::set_default(subscriber);
    let cfg = NodeConfig::default().listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap());
    let node = Node::start(cfg).await.unwrap();
    let id = node.peer_id().to_base58();
    let tag = format!("node{{peer={}}}", &id[id.len() - 6..]);
    node.shutdown().await;
    node.closed().await;
    tokio::task::yield_now().await;
    let logs = String::from_utf8(starling_dht::lock::lock(&out.0).clone()).unwrap();
    for line in ["fast lane listening", "swarm task stopped"] {
        assert!(
            logs.lines().any(|l| l.contains(line) && l.contains(&tag)),
            "no {line:?} tagged {tag} in:\n{logs}"
        );
    }
}

#[tokio::test]
async fn a_listen_on_a_taken_port_names_the_os_cause() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let cfg = crate::NodeConfig::default()
        .listen_on(format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap());
    let err = match Node::start(cfg).await {
        Ok(node) => {
            node.shutdown().await;
            panic!("listening on a taken port succeeded");
        }
        Err(e) => e,
    };
    let text = err.to_string();
    assert!(
        matches!(err, NodeError::Listen { .. }),
        "expected a listen error, got {text}"
    );
    // The OS's words ("Address already in use (os error 98)"), not an empty reason.
    assert!(
        text.to_lowercase().contains("in use") && text.contains("os error"),
        "{text}"
    );
    drop(taken);
}

/// `shutdown()` returns only once the swarm task has gone: a caller that checks `is_closed()`
/// right after it (the Python binding's context manager does) sees the node closed, on a
/// runtime whose other threads may not have run the task's last steps yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_reads_closed_as_soon_as_shutdown_returns() {
    for _ in 0..20 {
        let cfg = NodeConfig::default().listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap());
        let node = Node::start(cfg).await.unwrap();
        assert!(!node.is_closed());
        node.shutdown().await;
        assert!(node.is_closed());
        // Idempotent: a second shutdown on a closed node returns at once.
        node.shutdown().await;
        assert!(node.is_closed());
    }
}
