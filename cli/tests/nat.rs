//! NAT traversal for real: `starling` processes in network namespaces, two of them behind their
//! own masquerading routers (iptables `MASQUERADE`, unsolicited inbound packets dropped).
//!
//! The topology: a public bootstrap peer that is also a circuit relay (`starling node --relay`),
//! a public peer, and two NATed peers. The NATed peers must learn from autonat that they are
//! private, reserve a relay slot and become reachable at a `/p2p-circuit` address; one dials the
//! other through the relay, and dcutr attempts a hole punch, whose outcome is reported. Then all
//! four average together (the NATed peers as clients) and each writes and reads DHT records.
//!
//! Needs root, `ip` and `iptables`; skipped with a message otherwise, except in CI (`CI` set),
//! where it fails instead. Namespaces are deleted on exit, also on failure.

mod netns;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use netns::{field, start_node, Killer, NatHost, Net, Watch, BIN};

/// Elements per peer in the averaging phase, and rounds after the first (the workers' warm-up
/// round, which is enough to show that all four average together).
const SIZE: usize = 100_000;
const ROUNDS: usize = 2;
/// Upper bounds of each phase.
const RELAY_SETUP: Duration = Duration::from_secs(60);
const HOLE_PUNCH: Duration = Duration::from_secs(60);
const AVERAGING: Duration = Duration::from_secs(150);

/// Flags every node of the test network needs: its "public" addresses are private (10.x), so
/// autonat must use them.
const LAB: &str = "--autonat-private-ips";

/// The hosts: bridge host 0 runs the relay, bridge host 1 the public peer, and two hosts sit
/// behind NAT routers.
struct Topology {
    net: Net,
    natted: [NatHost; 2],
}

fn topology() -> Result<Topology, String> {
    let mut net = Net::create("nt", 2, 217)?;
    let natted = [net.add_nat_host()?, net.add_nat_host()?];
    Ok(Topology { net, natted })
}

/// `starling` in the namespace of host `i`: 0 and 1 on the bridge, 2 and 3 behind NATs.
fn command(t: &Topology, i: usize) -> Command {
    match i {
        0 | 1 => t.net.command(i, BIN),
        _ => t.net.command_in(&t.natted[i - 2].ns, BIN),
    }
}

/// Host `i`'s own address (a private one behind a NAT).
fn addr(t: &Topology, i: usize) -> String {
    match i {
        0 | 1 => t.net.addr(i),
        _ => t.natted[i - 2].private_addr.clone(),
    }
}

/// The peer id a `/p2p/<id>` address ends in.
fn peer_id(addr: &str) -> &str {
    addr.rsplit('/').next().unwrap_or_default()
}

/// What the relay phase measured, and the nodes it started.
struct RelayPhase {
    nodes: Vec<Killer>,
    /// Wall time from spawning each NATed node to its reservation line, and the node's own
    /// figures (ms after start, ms after the private verdict).
    setups: Vec<(Duration, String)>,
    hole_punch: String,
}

/// The relay phase: NATed nodes judge themselves private, reserve relay slots, and one dials
/// the other through the relay, which starts a hole punch.
fn relay_phase(t: &Topology, relay_addr: &str) -> RelayPhase {
    let mut keep = Vec::new();
    let tcp = |i: usize| format!("/ip4/{}/tcp/0", addr(t, i));
    let (public, _, public_out) = start_node(
        command(t, 1),
        &["--listen", &tcp(1), "--bootstrap", relay_addr, LAB],
    );
    keep.push(public);
    let mut public_out = Watch::new(public_out);
    // The second NATed peer starts first: the first dials its circuit address, built from the
    // relay's address and its peer id.
    let spawned = Instant::now();
    let (nat1, nat1_addr, nat1_out) = start_node(
        command(t, 3),
        &["--listen", &tcp(3), "--bootstrap", relay_addr, LAB],
    );
    keep.push(nat1);
    let circuit = format!("{relay_addr}/p2p-circuit/p2p/{}", peer_id(&nat1_addr));
    let (nat0, _, nat0_out) = start_node(
        command(t, 2),
        &[
            "--listen",
            &tcp(2),
            "--bootstrap",
            relay_addr,
            LAB,
            "--dial",
            &circuit,
        ],
    );
    keep.push(nat0);
    let mut outs = [Watch::new(nat0_out), Watch::new(nat1_out)];

    let deadline = spawned + RELAY_SETUP;
    let mut setups = Vec::new();
    for (k, out) in outs.iter_mut().enumerate() {
        let private = out.wait_for("reachability Private", deadline);
        assert!(
            private.is_some(),
            "NATed peer {k} never judged itself private: {:?}",
            out.seen
        );
        let reserved = out.wait_for("relay reservation accepted", deadline);
        let reserved =
            reserved.unwrap_or_else(|| panic!("NATed peer {k} got no relay slot: {:?}", out.seen));
        setups.push((spawned.elapsed(), reserved));
        let reachable = out.wait_for("reachable through a relay at", deadline);
        let reachable = reachable
            .unwrap_or_else(|| panic!("NATed peer {k} has no circuit address: {:?}", out.seen));
        assert!(reachable.contains("/p2p-circuit/p2p/"), "{reachable}");
    }
    assert!(
        public_out
            .wait_for("reachability Public", deadline)
            .is_some(),
        "the public peer never judged itself public: {:?}",
        public_out.seen
    );

    let deadline = Instant::now() + HOLE_PUNCH;
    let connected = outs[0].wait_for("connected to", deadline);
    assert!(
        connected.is_some_and(|l| l.contains(peer_id(&nat1_addr)) && l.contains("through a relay")),
        "NATed peer 0 did not reach peer 1 through the relay: {:?}",
        outs[0].seen
    );
    // dcutr reports on the side that dials as listener (the relayed connection's listener,
    // here peer 1) whatever happens, and on the other side when its dial succeeds.
    let hole_punch = outs[1]
        .wait_for("hole punch with", deadline)
        .or_else(|| outs[0].wait_for("hole punch with", Instant::now()))
        .unwrap_or_else(|| {
            panic!(
                "no hole punch was reported: {:?} / {:?}",
                outs[0].seen, outs[1].seen
            )
        });
    RelayPhase {
        nodes: keep,
        setups,
        hole_punch,
    }
}

/// One averaging worker's rounds: (span fraction, group size, relative error) per round.
type Rounds = Vec<(f64, usize, f64)>;

/// All four hosts average: each runs `bench allreduce-worker`, which waits for autonat's verdict
/// first, so that the NATed ones take part as clients.
fn averaging_phase(t: &Topology, relay_addr: &str) -> Vec<Rounds> {
    let mut workers = Vec::new();
    for i in 0..4 {
        let mut cmd = command(t, i);
        cmd.args(["bench", "allreduce-worker", "--bootstrap", relay_addr])
            .args(["--listen", &format!("/ip4/{}/tcp/0", addr(t, i))])
            .args(["--index", &i.to_string(), "--peers", "4"])
            .args(["--size", &SIZE.to_string(), "--rounds", &ROUNDS.to_string()])
            .args([LAB, "--await-reachability", "60"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("a worker starts");
        let out = child.stdout.take().expect("piped stdout");
        let lines = std::io::BufRead::lines(std::io::BufReader::new(out));
        workers.push((Killer(child), Watch::new(lines)));
    }
    let deadline = Instant::now() + AVERAGING;
    let mut all = Vec::new();
    for (i, (worker, out)) in workers.iter_mut().enumerate() {
        let mut rounds = Vec::new();
        for r in 0..=ROUNDS {
            let line = out
                .wait_for(&format!("{{\"round\":{r},"), deadline)
                .unwrap_or_else(|| panic!("worker {i} reported no round {r}: {:?}", out.seen));
            let group = field(&line, "group") as usize;
            rounds.push((
                field(&line, "span_fraction"),
                group,
                field(&line, "rel_error"),
            ));
        }
        let status = worker.0.wait().expect("the worker exits");
        assert!(status.success(), "worker {i} failed ({status})");
        all.push(rounds);
    }
    all
}

/// Runs `starling dht ...` on host `i` and returns its stdout; panics if it fails.
fn dht(t: &Topology, i: usize, args: &[&str], relay_addr: &str) -> String {
    let out = command(t, i)
        .arg("dht")
        .args(args)
        .args(["--bootstrap", relay_addr, "--timeout", "5"])
        .output()
        .expect("starling dht runs");
    assert!(
        out.status.success(),
        "host {i}: starling dht {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn natted_peers_get_relayed_punch_holes_average_and_use_the_dht() {
    if !netns::available(&["ip", "iptables"]) {
        return;
    }
    let started = Instant::now();
    let t = topology().expect("the namespaced NAT network builds");
    let mut keep = Vec::new();
    let relay_listen = format!("/ip4/{}/tcp/4001", t.net.addr(0));
    let (relay, relay_addr, relay_out) = start_node(
        command(&t, 0),
        &[
            "--relay",
            "--listen",
            &relay_listen,
            "--external",
            &relay_listen,
            LAB,
        ],
    );
    keep.push(relay);
    // Keep reading its output: a closed pipe would end it at its next line.
    let _relay_out = Watch::new(relay_out);

    let relay_phase = relay_phase(&t, &relay_addr);
    for (k, (wall, line)) in relay_phase.setups.iter().enumerate() {
        eprintln!(
            "NATed peer {k}: relay slot {:.1} s after spawning ({line})",
            wall.as_secs_f64()
        );
    }
    eprintln!("hole punch: {}", relay_phase.hole_punch);
    // MASQUERADE keeps the source port and the routers drop unsolicited packets instead of
    // resetting them, so dcutr's simultaneous dials meet: the punch should succeed, with a
    // direct connection to a router's public address.
    let punched_to_router = t.natted.iter().any(|n| {
        relay_phase
            .hole_punch
            .contains(&format!("direct connection to /ip4/{}/", n.public_addr))
    });
    assert!(
        punched_to_router,
        "no direct connection between the NATed peers: {}",
        relay_phase.hole_punch
    );

    // Only the relay stays. A second peer on a NATed host would reach the first over their
    // LAN, and autonat would take that dial-back as proof that the first is public.
    drop(relay_phase.nodes);
    let rounds = averaging_phase(&t, &relay_addr);
    for (i, w) in rounds.iter().enumerate() {
        for (r, (span, group, err)) in w.iter().enumerate() {
            assert_eq!(
                *group, 4,
                "worker {i} round {r}: a group of {group}, not all four"
            );
            assert!(*err < 1e-4, "worker {i} round {r}: relative error {err}");
            if i >= 2 {
                assert_eq!(
                    *span, 0.0,
                    "NATed worker {i} reduced a span: it should be a client"
                );
            } else {
                assert!(*span > 0.0, "public worker {i} reduced nothing");
            }
        }
    }
    eprintln!("averaging: all four in every round; the NATed peers as clients");

    for i in 0..4 {
        let hello = format!("hello from host {i}");
        dht(
            &t,
            i,
            &["put", "nat-test", &hello, "--subkey", &format!("host{i}")],
            &relay_addr,
        );
    }
    for i in 0..4 {
        let got = dht(&t, i, &["get", "nat-test"], &relay_addr);
        for j in 0..4 {
            assert!(
                got.contains(&format!("hello from host {j}")),
                "host {i} read {got:?}"
            );
        }
    }
    eprintln!(
        "DHT: every host wrote a record and read all four; {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
}
