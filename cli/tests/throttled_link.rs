//! A peer whose upload is throttled to a twentieth of the others' gets a small span (or none), and
//! the round is faster than with equal spans. Each peer is a `starling` process in its own network
//! namespace, joined through a bridge; `tc tbf` limits the links. Needs root, `ip` and `tc`;
//! skipped with a message otherwise, except in CI (`CI` set), where it fails instead.
//! Namespaces are deleted on exit, also on failure.

mod netns;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use netns::{field, start_node, Killer, Net, BIN};

const PEERS: usize = 4;
const SLOW: usize = 3;
const FAST_RATE: &str = "400mbit";
const SLOW_RATE: &str = "20mbit";

/// The test network: fast peers get FAST_RATE both ways; the slow peer SLOW_RATE upload and
/// FAST_RATE download, like a home connection. (On a symmetric slow link each peer must move
/// about (n-1)/n of the vector both ways in both phases whatever the split, so there the equal
/// share is already the best a butterfly can do; upload is what delegation saves.)
fn network() -> Result<Net, String> {
    let net = Net::create("tl", PEERS, 213)?;
    for i in 0..PEERS {
        let up = if i == SLOW { SLOW_RATE } else { FAST_RATE };
        net.throttle(i, up, FAST_RATE)?;
    }
    Ok(net)
}

#[derive(Debug, Clone)]
struct Sample {
    round: usize,
    allreduce_s: f64,
    span_fraction: f64,
    /// Reducers this peer sent a span to, and how many of those transfers used the fast lane.
    transfers: usize,
    fast_lane_transfers: usize,
    /// The upload rate this peer declares after the round (bytes/s).
    bandwidth: f64,
    /// This round's own measurement of it, if the round measured one.
    measured_upload: Option<f64>,
}

/// Runs one measured session of `rounds` rounds and returns each worker's samples.
fn session(net: &Net, equal: bool, size: usize, rounds: usize) -> Vec<Vec<Sample>> {
    // A bootstrap node in peer 0's namespace.
    let listen0 = format!("/ip4/{}/tcp/0", net.addr(0));
    let (_boot, boot_addr, _) = start_node(net.command(0, BIN), &["--listen", &listen0]);
    let mut workers = Vec::new();
    for i in 0..PEERS {
        let mut cmd = net.command(i, BIN);
        cmd.args(["bench", "allreduce-worker"])
            .args([
                "--bootstrap",
                &boot_addr,
                "--listen",
                &format!("/ip4/{}/tcp/0", net.addr(i)),
            ])
            .args([
                "--index",
                &i.to_string(),
                "--peers",
                &PEERS.to_string(),
                "--size",
                &size.to_string(),
            ])
            .args(["--rounds", &rounds.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if equal {
            cmd.arg("--equal-spans");
        }
        workers.push(Killer(cmd.spawn().unwrap()));
    }
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut all = Vec::new();
    for (i, w) in workers.iter_mut().enumerate() {
        let out = BufReader::new(w.0.stdout.take().unwrap());
        let samples: Vec<Sample> = out
            .lines()
            .map_while(Result::ok)
            // Every round's line, for a failure's diagnosis (shown with --nocapture).
            .inspect(|l| eprintln!("worker {i}: {l}"))
            .map(|l| Sample {
                round: field(&l, "round") as usize,
                allreduce_s: field(&l, "allreduce_s"),
                span_fraction: field(&l, "span_fraction"),
                transfers: field(&l, "transfers") as usize,
                fast_lane_transfers: field(&l, "fast_lane_transfers") as usize,
                bandwidth: field(&l, "bandwidth"),
                measured_upload: (!l.contains("\"measured_upload\":null"))
                    .then(|| field(&l, "measured_upload")),
            })
            .collect();
        assert!(w.0.wait().unwrap().success(), "worker {i} failed");
        assert!(Instant::now() < deadline, "session ran too long");
        all.push(samples);
    }
    all
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
fn throttled_peer_gets_a_small_span_and_the_round_is_faster() {
    if !netns::available(&["ip", "tc"]) {
        return;
    }
    let net = network().expect("the namespaced test network builds");
    let size = 1_000_000;
    let rounds = 3;
    let balanced = session(&net, false, size, rounds);
    let equal = session(&net, true, size, rounds);
    // Round 0 runs on the initial bandwidth guess; later rounds use what was measured.
    let late = |all: &Vec<Vec<Sample>>, f: &dyn Fn(&Sample) -> f64| -> Vec<f64> {
        (2..=rounds)
            .map(|r| {
                all.iter()
                    .map(|w| w.iter().find(|s| s.round == r).map(f).unwrap())
                    .fold(0.0, f64::max)
            })
            .collect()
    };
    let slow_fraction: Vec<f64> = balanced[SLOW]
        .iter()
        .filter(|s| s.round >= 2)
        .map(|s| s.span_fraction)
        .collect();
    // The estimate the split rests on: the throttled uplink measured as what it is, not as
    // what the socket buffers swallowed (a default 4 MiB send buffer made a 20 Mbit/s uplink
    // read as 6x faster, and the peer got a share).
    let mbit: f64 = SLOW_RATE.trim_end_matches("mbit").parse().unwrap();
    let link = mbit * 1e6 / 8.0;
    for s in balanced[SLOW].iter().filter(|s| s.round >= 2) {
        assert!(
            s.bandwidth < 2.0 * link && s.bandwidth > link / 8.0,
            "round {}: the throttled peer declares {:.2} MB/s on a {:.2} MB/s uplink",
            s.round,
            s.bandwidth / 1e6,
            link / 1e6
        );
    }
    // Every peer re-measures its uplink every round, on warm lanes too (each sends at least
    // 2 MiB in phase 1 here), so the estimates follow a link that changes.
    for (i, w) in balanced.iter().enumerate() {
        for s in w {
            assert!(
                s.measured_upload.is_some(),
                "worker {i} round {}: no upload measurement",
                s.round
            );
        }
    }
    for f in &slow_fraction {
        assert!(
            *f < 0.125,
            "the throttled peer reduced {f} of the vector (equal share: 0.25)"
        );
    }
    // Between namespaces (real interfaces, the throttled one included) spans travel on fast lanes.
    for s in balanced.iter().chain(&equal).flatten() {
        assert_eq!(
            s.fast_lane_transfers, s.transfers,
            "round {}: not every transfer used the fast lane",
            s.round
        );
    }
    let t_balanced = median(late(&balanced, &|s| s.allreduce_s));
    let t_equal = median(late(&equal, &|s| s.allreduce_s));
    eprintln!("throttled peer span fractions {slow_fraction:?}; all-reduce {t_balanced:.3} s balanced vs {t_equal:.3} s equal");
    assert!(
        t_balanced < t_equal,
        "balanced {t_balanced} s is not faster than equal spans {t_equal} s"
    );
}

/// `bench allreduce --netns ... --reference` between 4 hosts on 500 Mbit/s links, as the
/// namespace bench script runs it: the workers listen with the node's defaults (all
/// interfaces), Starling's rounds after the first reuse every fast lane, and both Starling's
/// all-reduce and the plain-TCP reference butterfly land on the mean. (Their times are printed,
/// not compared: that is the bench's job, on a quiet machine.)
#[test]
fn starling_and_the_tcp_reference_average_between_hosts_on_warm_lanes() {
    if !netns::available(&["ip", "tc"]) {
        return;
    }
    let net = Net::create("tr", PEERS, 214).expect("the namespaced test network builds");
    for i in 0..PEERS {
        net.throttle(i, "500mbit", "500mbit").expect("throttled");
    }
    let hosts: Vec<String> = (0..PEERS).map(|i| net.ns(i)).collect();
    let out = net
        .command(0, BIN)
        .args([
            "bench",
            "allreduce",
            "--procs",
            "--reference",
            "--codec",
            "u8",
        ])
        .args(["--netns", &hosts.join(",")])
        .args([
            "--peers",
            &PEERS.to_string(),
            "--size",
            "300000",
            "--rounds",
            "3",
        ])
        .stderr(Stdio::inherit())
        .output()
        .expect("bench allreduce runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench failed: {stdout}");
    let line = stdout.lines().last().expect("a JSON line");
    eprintln!("{line}");
    let (own, reference) = line
        .split_once("\"reference\":{")
        .expect("a reference part");
    assert_eq!(field(own, "incomplete_rounds"), 0.0);
    assert_eq!(
        field(own, "fast_lane_share"),
        1.0,
        "every transfer on a fast lane"
    );
    assert_eq!(
        field(own, "warm_lane_share"),
        1.0,
        "every measured round on warm lanes"
    );
    assert_eq!(field(reference, "incomplete_rounds"), 0.0);
    // u8 quantizes each peer's values (and, in the reference, the mean) once each way.
    for part in [own, reference] {
        let err = field(part, "max_rel_error");
        assert!(err < 0.05, "relative error {err} in {part}");
    }
    assert!(field(line, "vs_reference") > 0.0);
}
