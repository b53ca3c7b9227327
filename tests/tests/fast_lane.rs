//! The node's fast lane: direct encrypted TCP connections, requested over libp2p.

use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use starling_node::{Node, NodeConfig, NodeError, StreamProtocol};
use starling_tests::{bounded, init_tracing};
use tokio::io::AsyncWriteExt as _;

const ECHO: StreamProtocol = StreamProtocol::new("/test/echo/1");
const OTHER: StreamProtocol = StreamProtocol::new("/test/other/1");

fn cfg() -> NodeConfig {
    NodeConfig::default()
        .listen_on("/ip4/127.0.0.1/tcp/0".parse().unwrap())
        .with_request_timeout(Duration::from_secs(3))
}

async fn pair(dialer: NodeConfig) -> (Node, Node) {
    let server = Node::start(cfg()).await.unwrap();
    let addr = server.listen_addrs().await.unwrap()[0].clone();
    let client = Node::start(dialer).await.unwrap();
    client.dial(addr).await.unwrap();
    (server, client)
}

/// Echoes every lane on `ECHO` back to its sender, then closes it.
fn echo_server(node: &Node) -> tokio::task::JoinHandle<Vec<starling_node::PeerId>> {
    let mut incoming = node.accept_fast(ECHO).unwrap();
    tokio::spawn(async move {
        let mut seen = Vec::new();
        while let Some((peer, lane)) = incoming.recv().await {
            seen.push(peer);
            let (mut rd, mut wr) = lane.into_split();
            let mut buf = vec![0u8; 100_000];
            loop {
                let n = rd.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                wr.write_all(&buf[..n]).await.unwrap();
                wr.flush().await.unwrap();
            }
            wr.close().await.unwrap();
        }
        seen
    })
}

/// Writes 5 MB of varied bytes on a lane to the echo server, in odd sizes while the echo comes
/// back, closes it, and checks that every byte came back in order.
async fn echoes_five_megabytes(
    mut rd: starling_node::FastReader,
    mut wr: starling_node::FastWriter,
) {
    let data: Vec<u8> = (0..5_000_003u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let d = data.clone();
    let writer = tokio::spawn(async move {
        for c in d.chunks(77_777) {
            wr.write_all(c).await.unwrap();
        }
        wr.close().await.unwrap();
    });
    let mut back = Vec::new();
    rd.read_to_end(&mut back).await.unwrap();
    writer.await.unwrap();
    assert!(back == data, "echo differs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_carry_data_both_ways_between_authenticated_peers() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let (server, client) = pair(cfg()).await;
        let echo = echo_server(&server);
        for _ in 0..2 {
            let lane = client.open_fast(server.peer_id(), ECHO).await.unwrap();
            let (rd, wr) = lane.into_split();
            echoes_five_megabytes(rd, wr).await;
        }
        // Nothing is routed for a protocol without a handler: a clear refusal.
        match client.open_fast(server.peer_id(), OTHER).await {
            Err(NodeError::FastLane(why)) => assert!(why.contains("refused"), "{why}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        // A second handler for one protocol is refused.
        assert!(server.accept_fast(ECHO).is_err());
        server.shutdown().await;
        // The handler's queue ends with the node; it saw exactly the client, twice.
        let seen = echo.await.unwrap();
        assert_eq!(seen, vec![client.peer_id(); 2]);
        client.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_on_the_lane_port_get_nothing_and_client_mode_only_dials() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let (server, client) = pair(NodeConfig::default().client(true)).await;
        let mut incoming = server.accept_fast(ECHO).unwrap();
        let port = server
            .fast_lane_port()
            .expect("a listening node has a lane port");
        // Client mode listens for nothing.
        assert_eq!(client.fast_lane_port(), None);
        assert!(client.accept_fast(ECHO).is_err());

        // Strangers who never asked over libp2p: random tokens, garbage, an early hang-up.
        for junk in [
            vec![0u8; 16],
            vec![7u8; 100_000],
            b"GET / HTTP/1.1\r\n\r\n".to_vec(),
            vec![],
        ] {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            let _ = s.write_all(&junk).await;
            let _ = s.shutdown().await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            incoming.try_recv().is_err(),
            "no stranger's connection was routed"
        );

        // A client-mode node dials lanes out; the server sees who it is.
        let mut lane = client.open_fast(server.peer_id(), ECHO).await.unwrap();
        let (peer, mut inbound) = incoming.recv().await.unwrap();
        assert_eq!(peer, client.peer_id());
        lane.write_all(b"ping").await.unwrap();
        lane.flush().await.unwrap();
        let mut got = [0u8; 4];
        inbound.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");

        // Stopping a node cuts its open lanes: the other side reads a truncated stream.
        server.shutdown().await;
        let mut rest = Vec::new();
        let e = bounded(Duration::from_secs(10), lane.read_to_end(&mut rest))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        client.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_the_fast_lane_neither_listens_nor_dials() {
    init_tracing();
    bounded(Duration::from_secs(30), async {
        let mut off = cfg();
        off.fast_lane = false;
        let (server, client) = pair(off).await;
        let _incoming = server.accept_fast(ECHO).unwrap();
        assert_eq!(client.fast_lane_port(), None);
        assert!(matches!(
            client.open_fast(server.peer_id(), ECHO).await,
            Err(NodeError::FastLane(_))
        ));
        // A peer we are not connected to: no lane, and no hang.
        let stranger = Node::start(cfg()).await.unwrap();
        assert!(matches!(
            stranger.open_fast(client.peer_id(), ECHO).await,
            Err(NodeError::FastLane(_))
        ));
        for n in [server, client, stranger] {
            n.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_swarm_members_get_lanes_and_outsiders_cannot_ask() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let key = starling_node::SwarmKey::generate();
        let (server, member) = {
            let server = Node::start(cfg().with_swarm_key(key)).await.unwrap();
            let addr = server.listen_addrs().await.unwrap()[0].clone();
            let member = Node::start(cfg().with_swarm_key(key)).await.unwrap();
            member.dial(addr.clone()).await.unwrap();
            (server, member)
        };
        let echo = echo_server(&server);
        let mut lane = member.open_fast(server.peer_id(), ECHO).await.unwrap();
        lane.write_all(b"inside").await.unwrap();
        lane.close().await.unwrap();
        let mut back = Vec::new();
        lane.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"inside");
        // Without the swarm key there is no libp2p connection, hence no way to ask for a lane.
        let outsider = Node::start(cfg()).await.unwrap();
        let addr = server.listen_addrs().await.unwrap()[0].clone();
        assert!(outsider.dial(addr).await.is_err());
        assert!(matches!(
            outsider.open_fast(server.peer_id(), ECHO).await,
            Err(NodeError::FastLane(_))
        ));
        for n in [server, member, outsider] {
            n.shutdown().await;
        }
        assert_eq!(echo.await.unwrap().len(), 1);
    })
    .await;
}

/// `NodeConfig::simulated_rtt` (a bench's simulation): with 120 ms set on both nodes, a libp2p
/// stream's and a lane's round trip each take at least 120 ms, and 5 MB echoed on the lane
/// arrive intact. Without it, the same round trips take a few milliseconds on loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_round_trip_time_delays_streams_and_lanes_and_loses_nothing() {
    init_tracing();
    bounded(Duration::from_secs(60), async {
        let rtt = Duration::from_millis(120);
        let mut delayed = cfg();
        delayed.simulated_rtt = Some(rtt);
        let server = Node::start(delayed.clone()).await.unwrap();
        let addr = server.listen_addrs().await.unwrap()[0].clone();
        let client = Node::start(delayed).await.unwrap();
        client.dial(addr).await.unwrap();
        let echo = echo_server(&server);
        // A libp2p stream: one byte there and back.
        let mut incoming = server.stream_control().accept(OTHER).unwrap();
        let stream_echo = tokio::spawn(async move {
            let (_, mut s) = futures::StreamExt::next(&mut incoming).await.unwrap();
            let mut b = [0u8; 1];
            s.read_exact(&mut b).await.unwrap();
            s.write_all(&b).await.unwrap();
            s.flush().await.unwrap();
        });
        let mut s = client
            .stream_control()
            .open_stream(server.peer_id(), OTHER)
            .await
            .unwrap();
        let start = std::time::Instant::now();
        s.write_all(&[9]).await.unwrap();
        s.flush().await.unwrap();
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.unwrap();
        let took = start.elapsed();
        assert_eq!(b, [9]);
        assert!(took >= rtt, "a stream's round trip took {took:?}");
        stream_echo.await.unwrap();
        // A lane: a byte's round trip, then 5 MB echoed.
        let lane = client.open_fast(server.peer_id(), ECHO).await.unwrap();
        let (mut rd, mut wr) = lane.into_split();
        let start = std::time::Instant::now();
        wr.write_all(&[5]).await.unwrap();
        wr.flush().await.unwrap();
        rd.read_exact(&mut b).await.unwrap();
        let took = start.elapsed();
        assert_eq!(b, [5]);
        assert!(took >= rtt, "a lane's round trip took {took:?}");
        echoes_five_megabytes(rd, wr).await;
        server.shutdown().await;
        client.shutdown().await;
        echo.abort();
    })
    .await;
}
