//! A peer whose upload is throttled to a twentieth of the others' gets a small span (or none), and
//! the round is faster than with equal spans. Each peer is a `starling` process in its own network
//! namespace, joined through a bridge; `tc tbf` limits the links. Needs root, `ip` and `tc`;
//! skipped with a message otherwise. Namespaces are deleted on exit, also on failure.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_starling");
const PEERS: usize = 4;
const SLOW: usize = 3;
const FAST_RATE: &str = "400mbit";
const SLOW_RATE: &str = "20mbit";

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespaces of one test run; deleted on drop.
struct Net {
    tag: String,
    subnet: String,
}

impl Net {
    fn ns(&self, i: usize) -> String {
        format!("stl-{}-{i}", self.tag)
    }
    fn hub(&self) -> String {
        format!("stl-{}-hub", self.tag)
    }
    fn addr(&self, i: usize) -> String {
        format!("{}.{}", self.subnet, i + 1)
    }

    fn create() -> Result<Net, String> {
        let pid = std::process::id();
        let net = Net {
            tag: format!("{pid}"),
            subnet: format!("10.213.{}", pid % 250),
        };
        let hub = net.hub();
        sh(&["ip", "netns", "add", &hub])?;
        sh(&["ip", "-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", &hub, "link", "set", "br0", "up"])?;
        for i in 0..PEERS {
            let ns = net.ns(i);
            let (inner, outer) = (format!("s{pid}p{i}"), format!("s{pid}h{i}"));
            let (inner, outer) = (
                &inner[inner.len().saturating_sub(15)..],
                &outer[outer.len().saturating_sub(15)..],
            );
            sh(&["ip", "netns", "add", &ns])?;
            sh(&[
                "ip", "link", "add", inner, "type", "veth", "peer", "name", outer,
            ])?;
            sh(&["ip", "link", "set", inner, "netns", &ns])?;
            sh(&["ip", "link", "set", outer, "netns", &hub])?;
            sh(&["ip", "-n", &ns, "link", "set", inner, "name", "eth0"])?;
            sh(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", net.addr(i)),
                "dev",
                "eth0",
            ])?;
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
            sh(&["ip", "-n", &hub, "link", "set", outer, "master", "br0"])?;
            sh(&["ip", "-n", &hub, "link", "set", outer, "up"])?;
            // Fast peers: FAST_RATE both ways. The slow peer: SLOW_RATE upload, FAST_RATE download,
            // like a home connection. (On a symmetric slow link each peer must move about
            // (n-1)/n of the vector both ways in both phases whatever the split, so there the
            // equal share is already the best a butterfly can do; upload is what delegation saves.)
            let rate = if i == SLOW { SLOW_RATE } else { FAST_RATE };
            sh(&[
                "ip", "netns", "exec", &ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                "rate", rate, "burst", "64kb", "latency", "50ms",
            ])?;
            sh(&[
                "ip", "netns", "exec", &hub, "tc", "qdisc", "add", "dev", outer, "root", "tbf",
                "rate", FAST_RATE, "burst", "64kb", "latency", "50ms",
            ])?;
        }
        Ok(net)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 0..PEERS {
            let _ = sh(&["ip", "netns", "del", &self.ns(i)]);
        }
        let _ = sh(&["ip", "netns", "del", &self.hub()]);
    }
}

struct Killer(Child);
impl Drop for Killer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[derive(Debug, Clone)]
struct Sample {
    round: usize,
    allreduce_s: f64,
    span_fraction: f64,
    /// Reducers this peer sent a span to, and how many of those transfers used the fast lane.
    transfers: usize,
    fast_lane_transfers: usize,
}

fn field(line: &str, name: &str) -> f64 {
    let key = format!("\"{name}\":");
    let start = line
        .find(&key)
        .unwrap_or_else(|| panic!("{name} missing in {line}"))
        + key.len();
    let rest = &line[start..];
    let end = rest.find([',', '}']).unwrap();
    rest[..end].parse().unwrap()
}

/// Runs one measured session of `rounds` rounds and returns each worker's samples.
fn session(net: &Net, equal: bool, size: usize, rounds: usize) -> Vec<Vec<Sample>> {
    // A bootstrap node in peer 0's namespace.
    let mut boot = Command::new("ip")
        .args([
            "netns",
            "exec",
            &net.ns(0),
            BIN,
            "node",
            "--listen",
            &format!("/ip4/{}/tcp/0", net.addr(0)),
            "--status-interval",
            "3600",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(boot.stdout.take().unwrap()).lines();
    let boot_addr = loop {
        let line = lines
            .next()
            .expect("bootstrap node printed its address")
            .unwrap();
        if let Some(a) = line.strip_prefix("listening on ") {
            break a.to_string();
        }
    };
    let _boot = Killer(boot);
    let mut workers = Vec::new();
    for i in 0..PEERS {
        let mut cmd = Command::new("ip");
        cmd.args([
            "netns",
            "exec",
            &net.ns(i),
            BIN,
            "bench",
            "allreduce-worker",
        ])
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
            .map(|l| Sample {
                round: field(&l, "round") as usize,
                allreduce_s: field(&l, "allreduce_s"),
                span_fraction: field(&l, "span_fraction"),
                transfers: field(&l, "transfers") as usize,
                fast_lane_transfers: field(&l, "fast_lane_transfers") as usize,
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
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false);
    if !root || sh(&["ip", "-V"]).is_err() || sh(&["tc", "-V"]).is_err() {
        eprintln!("SKIPPED: needs root with iproute2 (ip, tc) to build network namespaces");
        return;
    }
    let net = match Net::create() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("SKIPPED: cannot build the namespaced test network: {e}");
            return;
        }
    };
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
