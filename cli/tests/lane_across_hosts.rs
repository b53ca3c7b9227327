//! The fast lane between two hosts, set up as a new user would: every `starling` process runs
//! with the default listen address (no `--listen`). Two network namespaces on a bridge; host 0
//! runs the bootstrap `starling node` and two averaging workers, host 1 two more workers. Every
//! span transfer, across the bridge too, must use the fast lane, and every result must be the
//! exact mean. Needs root and `ip`; skipped with a message otherwise, except in CI (`CI` set),
//! where it fails instead. Namespaces are deleted on exit, also on failure.

mod netns;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use netns::{field, start_node, Killer, Net, BIN};

const HOSTS: usize = 2;
const PEERS: usize = 4;
const SIZE: usize = 200_000;
const ROUNDS: usize = 2;

#[test]
fn averaging_between_hosts_with_default_addresses_uses_the_fast_lane_only() {
    if !netns::available(&["ip"]) {
        return;
    }
    let net = Net::create("lh", HOSTS, 214).expect("the namespaced test network builds");
    let (_boot, boot_addr, mut boot_out) = start_node(net.command(0, BIN), &[]);
    // What a user copies from the first line: an address the other host can dial.
    assert!(
        boot_addr.starts_with(&format!("/ip4/{}/tcp/", net.addr(0))),
        "first address printed is {boot_addr}, not host 0's bridge address {}",
        net.addr(0)
    );
    let lane_line = boot_out
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.starts_with("fast lane on TCP port"))
        .expect("the node prints its fast lane port");
    assert!(lane_line.contains("all interfaces"), "{lane_line}");

    let mut workers = Vec::new();
    for i in 0..PEERS {
        let host = i % HOSTS;
        let mut cmd = net.command(host, BIN);
        cmd.args(["bench", "allreduce-worker", "--bootstrap", &boot_addr])
            .args(["--index", &i.to_string(), "--peers", &PEERS.to_string()])
            .args(["--size", &SIZE.to_string(), "--rounds", &ROUNDS.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        workers.push(Killer(cmd.spawn().expect("a worker starts")));
    }
    for (i, w) in workers.iter_mut().enumerate() {
        let out = BufReader::new(w.0.stdout.take().expect("piped stdout"));
        let lines: Vec<String> = out.lines().map_while(Result::ok).collect();
        assert!(w.0.wait().unwrap().success(), "worker {i} failed");
        assert_eq!(lines.len(), ROUNDS + 1, "worker {i} printed {lines:?}");
        for l in &lines {
            assert_eq!(field(l, "group") as usize, PEERS, "worker {i}: {l}");
            let transfers = field(l, "transfers");
            assert!(transfers >= 1.0, "worker {i} sent no span: {l}");
            assert_eq!(
                field(l, "fast_lane_transfers"),
                transfers,
                "worker {i} on host {}: not every transfer used the fast lane: {l}",
                i % HOSTS
            );
            assert!(field(l, "rel_error") < 1e-6, "worker {i}: {l}");
        }
    }
}
