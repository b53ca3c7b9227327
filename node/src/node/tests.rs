//! The swarm task and fast lane log inside the node's tracing span.

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
