//! The lane's listener and dialer without libp2p: offers are made by calling
//! [`FastLane::offer`] as the offer stream would, connections are real loopback sockets.

use super::gate::Slot;
use super::listener::{serve_connections, HANDSHAKE_DEADLINE};
use super::*;
use tokio::net::TcpListener;

const PROTO: &str = "/test/1";

fn offer(token: Token, secret: Secret) -> Handshake {
    Handshake::Offer {
        protocol: PROTO.into(),
        token,
        secret,
    }
}

/// A lane state listening on 127.0.0.1 (accept loop running, no libp2p) with a handler for
/// [`PROTO`] whose queue holds `queue` lanes.
async fn listening(queue: usize) -> (Arc<FastLane>, IncomingFast, SocketAddr) {
    let ip: IpAddr = "127.0.0.1".parse().unwrap();
    let l = listener::bind(&[ip], 0).unwrap().remove(0);
    let addr = l.local_addr().unwrap();
    let lane = Arc::new(FastLane::with_parts(
        vec![addr],
        Duration::from_secs(5),
        queue,
        None,
        None,
    ));
    let task = tokio::spawn(serve_connections(Arc::downgrade(&lane), l));
    lock(&lane.tasks).push(task);
    let rx = lane.accept(&StreamProtocol::new(PROTO)).unwrap();
    (lane, rx, addr)
}

/// Has `lane` accept a fresh offer from `peer`, whose libp2p connection comes from `ip`;
/// returns the token and the keys the dialer derives from the answer.
fn offered(lane: &FastLane, peer: PeerId, ip: Option<IpAddr>) -> (Token, Keys) {
    let (token, secret) = lane.fresh_secrets().unwrap();
    match lane.offer(peer, ip, offer(token, secret)) {
        Handshake::Accept { random, .. } => (token, derive_keys(&token, &secret, &random).unwrap()),
        other => panic!("offer refused: {other:?}"),
    }
}

/// Both ends of a loopback connection: (dialer's, listener's).
async fn socket_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (a, b) = tokio::join!(TcpStream::connect(l.local_addr().unwrap()), l.accept());
    (a.unwrap(), b.unwrap().0)
}

#[tokio::test]
async fn offers_are_bounded_per_peer_and_tokens_are_single_use() {
    let lane = FastLane::with_parts(
        vec!["127.0.0.1:9".parse().unwrap()],
        Duration::from_secs(5),
        1,
        None,
        None,
    );
    let _rx = lane.accept(&StreamProtocol::new(PROTO)).unwrap();
    let (greedy, other) = (PeerId::random(), PeerId::random());
    for i in 0..MAX_PENDING_PER_PEER as u8 {
        assert!(matches!(
            lane.offer(greedy, None, offer([i; 16], [0; 32])),
            Handshake::Accept { ref addrs, .. } if addrs[0].port() == 9
        ));
    }
    assert!(matches!(
        lane.offer(greedy, None, offer([200; 16], [0; 32])),
        Handshake::Refuse(_)
    ));
    // Another peer is not locked out, but cannot reuse a pending token.
    assert!(matches!(
        lane.offer(other, None, offer([201; 16], [0; 32])),
        Handshake::Accept { .. }
    ));
    assert!(matches!(
        lane.offer(other, None, offer([0; 16], [0; 32])),
        Handshake::Refuse(_)
    ));
    // No handler for the protocol: refused.
    let stray = Handshake::Offer {
        protocol: "/nobody/1".into(),
        token: [202; 16],
        secret: [0; 32],
    };
    assert!(matches!(
        lane.offer(other, None, stray),
        Handshake::Refuse(_)
    ));
}

#[tokio::test]
async fn the_listener_adds_its_own_randomness_to_the_keys() {
    let lane = FastLane::with_parts(
        vec!["127.0.0.1:9".parse().unwrap()],
        Duration::from_secs(5),
        1,
        None,
        None,
    );
    let _rx = lane.accept(&StreamProtocol::new(PROTO)).unwrap();
    let peer = PeerId::random();
    // A broken dialer sends the same token and secret twice (once the first lane is used).
    let (token, secret) = ([5u8; 16], [6u8; 32]);
    let mut keys = Vec::new();
    for _ in 0..2 {
        let Handshake::Accept { random, .. } = lane.offer(peer, None, offer(token, secret)) else {
            panic!("offer refused");
        };
        let (_, _, held) = lock(&lane.offers).get(&token, Instant::now()).unwrap();
        assert_eq!(held, derive_keys(&token, &secret, &random).unwrap());
        keys.push(held);
        assert!(lock(&lane.offers).take(&token));
    }
    assert_ne!(keys[0][..32], keys[1][..32], "dialer→listener key reused");
    assert_ne!(keys[0][32..], keys[1][32..], "listener→dialer key reused");
}

#[tokio::test]
async fn a_connection_gets_one_short_deadline_for_its_token_and_hello() {
    assert!(HANDSHAKE_DEADLINE <= Duration::from_secs(1));
    let lane = FastLane::with_parts(
        vec!["127.0.0.1:9".parse().unwrap()],
        Duration::from_secs(5),
        1,
        None,
        None,
    );
    let _rx = lane.accept(&StreamProtocol::new(PROTO)).unwrap();
    let (token, _) = offered(&lane, PeerId::random(), None);
    // Silent; most of a token; a valid token but no hello: each is cut at the deadline (timers
    // never fire early; how late they fire is the machine's business, not the test's).
    for sent in [Vec::new(), token[..15].to_vec(), token.to_vec()] {
        let (mut dialer, accepted) = socket_pair().await;
        dialer.write_all(&sent).await.unwrap();
        let start = Instant::now();
        let e = lane.admit(accepted, None).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(start.elapsed() >= HANDSHAKE_DEADLINE);
    }
}

#[tokio::test]
async fn a_hello_of_the_wrong_size_or_key_is_refused_without_waiting_for_more() {
    let (lane, mut incoming, addr) = listening(4).await;
    let peer = PeerId::random();
    let (token, keys) = offered(&lane, peer, None);
    let good = seal_greeting(&keys[..32], HELLO).unwrap();
    let mut long = good;
    long[..4].copy_from_slice(&(MAX_RECORD as u32).to_le_bytes());
    let wrong_key = seal_greeting(&keys[32..], HELLO).unwrap();
    for hello in [long, wrong_key] {
        let (mut dialer, accepted) = socket_pair().await;
        dialer.write_all(&token).await.unwrap();
        dialer.write_all(&hello).await.unwrap();
        let e = lane.admit(accepted, None).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    }
    // A failed proof does not burn the offer: its real dialer still gets the lane.
    let dialer = FastLane::dial_only(Duration::from_secs(5), None);
    let mut lane_out = dialer.connect(addr, &token, &keys).await.unwrap();
    let (from, mut lane_in) = incoming.recv().await.unwrap();
    assert_eq!(from, peer);
    lane_out.write_all(b"after the greetings").await.unwrap();
    lane_out.flush().await.unwrap();
    let mut got = [0u8; 19];
    futures::AsyncReadExt::read_exact(&mut lane_in, &mut got)
        .await
        .unwrap();
    assert_eq!(&got, b"after the greetings");
    // Used once: the same proof again is refused.
    assert!(dialer.connect(addr, &token, &keys).await.is_err());
}

#[tokio::test]
async fn no_ready_without_a_place_in_the_handlers_queue() {
    let (lane, mut incoming, addr) = listening(1).await;
    let dialer = FastLane::dial_only(Duration::from_secs(5), None);
    let peer = PeerId::random();
    let (t1, k1) = offered(&lane, peer, None);
    let (t2, k2) = offered(&lane, peer, None);
    let _first = dialer.connect(addr, &t1, &k1).await.unwrap();
    // The queue's one place is taken: the second dialer is told so (no READY), rather than
    // handed a lane that the listener then drops.
    let e = dialer.connect(addr, &t2, &k2).await.unwrap_err();
    assert!(
        matches!(
            e.kind(),
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
        ),
        "{e}"
    );
    assert!(incoming.recv().await.is_some());
    assert!(incoming.try_recv().is_err(), "exactly one lane was routed");
}

#[tokio::test]
async fn strangers_filling_every_place_do_not_keep_out_a_peer_with_an_offer() {
    let lane = FastLane::with_parts(
        vec!["127.0.0.1:9".parse().unwrap()],
        Duration::from_secs(5),
        1,
        None,
        None,
    );
    let _rx = lane.accept(&StreamProtocol::new(PROTO)).unwrap();
    let ip = |last: u8| IpAddr::from([127, 0, 0, last]);
    // One source gets its share, no more.
    let one: Vec<_> = (0..2 * MAX_UNAUTHENTICATED_PER_IP)
        .filter_map(|_| lane.ticket_for(ip(2)))
        .collect();
    assert_eq!(one.len(), MAX_UNAUTHENTICATED_PER_IP);
    // Many sources fill every general place.
    let mut strangers = one;
    for last in 3..=255 {
        strangers.extend((0..MAX_UNAUTHENTICATED_PER_IP).filter_map(|_| lane.ticket_for(ip(last))));
    }
    assert_eq!(strangers.len(), MAX_UNAUTHENTICATED);
    let member = ip(1);
    assert!(lane.ticket_for(member).is_none());
    // A peer connected from `member` has two offers pending: two places, whatever strangers do.
    let peer = PeerId::random();
    offered(&lane, peer, Some(member));
    offered(&lane, peer, Some(member));
    let places: Vec<_> = (0..3).filter_map(|_| lane.ticket_for(member)).collect();
    assert_eq!(places.len(), 2);
    assert!(places.iter().all(|t| t.slot() == Slot::Expected));
    // An IPv4 peer seen through an IPv6 socket counts as the same IP.
    drop(places);
    let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
    assert!(lane.ticket_for(mapped).is_some());
}
