//! Test hosts with real links: network namespaces joined by a bridge, for tests that run
//! `starling` processes as separate machines would (addresses, lanes, NAT, throttled links).
//!
//! Each test builds its own namespaces (names and a /24 subnet derived from its pid and a tag)
//! and deletes them on drop, also on failure. Namespaces need root and `ip` (Debian
//! `iproute2`); hosts behind a NAT ([`Net::add_nat_host`]) also need `iptables` (Debian
//! `iptables`). [`available`] tells whether they can be built, and fails loudly when they
//! cannot while `CI` is set (CI runs as root, so a skip there would hide a broken test).
#![allow(dead_code)] // each test binary uses its own part of this module

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Instant;

/// The `starling` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_starling");

/// Runs a command, returning its stderr as the error when it fails.
pub fn sh(args: &[&str]) -> Result<(), String> {
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

/// Whether this process can build namespaces with the given tools (root and each command
/// answering `-V`/`--version`). Outside CI a missing capability prints `SKIPPED: ...` and
/// returns false; with `CI` set it panics, so CI never passes by skipping.
pub fn available(tools: &[&str]) -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false);
    let mut missing: Vec<String> = Vec::new();
    if !root {
        missing.push("root".into());
    }
    for tool in tools {
        let ok = sh(&[tool, "-V"]).is_ok() || sh(&[tool, "--version"]).is_ok();
        if !ok {
            missing.push((*tool).to_string());
        }
    }
    if missing.is_empty() {
        return true;
    }
    let why = format!("needs {} to build network namespaces", missing.join(", "));
    if std::env::var_os("CI").is_some() {
        panic!("{why}; CI must provide them (.ci/run installs the packages)");
    }
    eprintln!("SKIPPED: {why}");
    false
}

/// Hosts on one bridge: host `i` is namespace [`Net::ns`]`(i)` with `eth0` at
/// [`Net::addr`]`(i)` in a /24; the bridge lives in its own namespace ([`Net::hub`]).
pub struct Net {
    tag: String,
    subnet: String,
    hosts: usize,
    /// Extra namespaces to delete on drop (routers, hosts behind them).
    extra: Vec<String>,
    /// NAT routers plugged so far.
    nats: usize,
}

/// A host behind its own masquerading router, made by [`Net::add_nat_host`].
pub struct NatHost {
    /// The host's namespace.
    pub ns: String,
    /// The router's namespace.
    pub router: String,
    /// The host's address on its private /24.
    pub private_addr: String,
    /// The router's address on the bridge: what every other host sees the NATed host at.
    pub public_addr: String,
}

impl Net {
    /// Builds `hosts` namespaces on a bridge. `tag` (a few letters) keeps names apart when
    /// several tests of one binary build networks at the same time; `third_octet_seed` picks
    /// the subnet `10.<seed>.<pid % 250>.0/24`.
    pub fn create(tag: &str, hosts: usize, third_octet_seed: u8) -> Result<Net, String> {
        let pid = std::process::id();
        let net = Net {
            tag: format!("{tag}{pid}"),
            subnet: format!("10.{third_octet_seed}.{}", pid % 250),
            hosts: 0,
            extra: Vec::new(),
            nats: 0,
        };
        let mut net = net;
        let hub = net.hub();
        sh(&["ip", "netns", "add", &hub])?;
        sh(&["ip", "-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        sh(&["ip", "-n", &hub, "link", "set", "br0", "up"])?;
        for i in 0..hosts {
            net.hosts = i + 1;
            net.plug(&net.ns(i), &net.addr(i), i)?;
        }
        Ok(net)
    }

    /// The namespace of host `i`.
    pub fn ns(&self, i: usize) -> String {
        format!("stl-{}-{i}", self.tag)
    }

    /// The namespace holding the bridge.
    pub fn hub(&self) -> String {
        format!("stl-{}-hub", self.tag)
    }

    /// Host `i`'s address on the bridge.
    pub fn addr(&self, i: usize) -> String {
        format!("{}.{}", self.subnet, i + 1)
    }

    /// Name of the bridge-side end of the veth pair of the `slot`-th plugged namespace.
    pub fn outer_if(&self, slot: usize) -> String {
        let name = format!("v{}h{slot}", self.tag);
        name[name.len().saturating_sub(15)..].to_string()
    }

    /// Connects namespace `ns` (created here if absent) to the bridge as `eth0` with `addr`/24.
    fn plug(&self, ns: &str, addr: &str, slot: usize) -> Result<(), String> {
        let hub = self.hub();
        let inner = format!("v{}p{slot}", self.tag);
        let inner = &inner[inner.len().saturating_sub(15)..];
        let outer = self.outer_if(slot);
        if sh(&["ip", "netns", "pids", ns]).is_err() {
            sh(&["ip", "netns", "add", ns])?;
        }
        sh(&[
            "ip", "link", "add", inner, "type", "veth", "peer", "name", &outer,
        ])?;
        sh(&["ip", "link", "set", inner, "netns", ns])?;
        sh(&["ip", "link", "set", &outer, "netns", &hub])?;
        sh(&["ip", "-n", ns, "link", "set", inner, "name", "eth0"])?;
        sh(&[
            "ip",
            "-n",
            ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            "eth0",
        ])?;
        sh(&["ip", "-n", ns, "link", "set", "eth0", "up"])?;
        sh(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        sh(&["ip", "-n", &hub, "link", "set", &outer, "master", "br0"])?;
        sh(&["ip", "-n", &hub, "link", "set", &outer, "up"])?;
        Ok(())
    }

    /// A command run inside host `i`'s namespace.
    pub fn command(&self, i: usize, program: &str) -> Command {
        self.command_in(&self.ns(i), program)
    }

    /// A command run inside namespace `ns`.
    pub fn command_in(&self, ns: &str, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns, program]);
        c
    }

    /// Remembers a namespace made outside [`Net::create`] (a NAT router, a host behind it) so
    /// that it is deleted with the network.
    pub fn adopt(&mut self, ns: String) {
        self.extra.push(ns);
    }

    /// Adds a host behind its own NAT router: the router is plugged into the bridge (at
    /// `<subnet>.<101 + k>` for the `k`-th router) and masquerades the host's private /24
    /// (`192.168.<k + 1>.0/24`, the host at `.2`) behind that address, like a home router: the
    /// host's outbound connections get the router's address (iptables `MASQUERADE`, which keeps
    /// source ports where it can, so the mapping is endpoint-independent: a cone NAT), and
    /// inbound packets that answer no outbound connection are dropped.
    pub fn add_nat_host(&mut self) -> Result<NatHost, String> {
        let k = self.nats;
        self.nats += 1;
        let host = NatHost {
            ns: format!("stl-{}-n{k}", self.tag),
            router: format!("stl-{}-r{k}", self.tag),
            private_addr: format!("192.168.{}.2", k + 1),
            public_addr: format!("{}.{}", self.subnet, 101 + k),
        };
        self.adopt(host.router.clone());
        self.adopt(host.ns.clone());
        // Router slots follow the bridge hosts' slots, so veth names never clash.
        self.plug(&host.router, &host.public_addr, 100 + k)?;
        let lan = |end: char| {
            let name = format!("v{}{end}{k}", self.tag);
            name[name.len().saturating_sub(15)..].to_string()
        };
        let (router_if, host_if) = (lan('r'), lan('n'));
        sh(&["ip", "netns", "add", &host.ns])?;
        sh(&[
            "ip", "link", "add", &router_if, "type", "veth", "peer", "name", &host_if,
        ])?;
        sh(&["ip", "link", "set", &router_if, "netns", &host.router])?;
        sh(&["ip", "link", "set", &host_if, "netns", &host.ns])?;
        let gateway = format!("192.168.{}.1", k + 1);
        let r = |args: &[&str]| {
            let mut v = vec!["ip", "netns", "exec", host.router.as_str()];
            v.extend_from_slice(args);
            sh(&v)
        };
        r(&["ip", "link", "set", &router_if, "name", "lan0"])?;
        r(&["ip", "addr", "add", &format!("{gateway}/24"), "dev", "lan0"])?;
        r(&["ip", "link", "set", "lan0", "up"])?;
        r(&["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])?;
        r(&[
            "iptables",
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-o",
            "eth0",
            "-j",
            "MASQUERADE",
        ])?;
        for chain in ["INPUT", "FORWARD"] {
            r(&[
                "iptables",
                "-A",
                chain,
                "-i",
                "eth0",
                "-m",
                "conntrack",
                "--ctstate",
                "ESTABLISHED,RELATED",
                "-j",
                "ACCEPT",
            ])?;
            r(&["iptables", "-A", chain, "-i", "eth0", "-j", "DROP"])?;
        }
        let h = |args: &[&str]| {
            let mut v = vec!["ip", "-n", host.ns.as_str()];
            v.extend_from_slice(args);
            sh(&v)
        };
        h(&["link", "set", &host_if, "name", "eth0"])?;
        h(&[
            "addr",
            "add",
            &format!("{}/24", host.private_addr),
            "dev",
            "eth0",
        ])?;
        h(&["link", "set", "eth0", "up"])?;
        h(&["link", "set", "lo", "up"])?;
        h(&["route", "add", "default", "via", &gateway])?;
        Ok(host)
    }

    /// Limits host `i`'s upload to `rate` (a `tc` rate such as `100mbit`) and its download,
    /// on the bridge side, to `down`.
    pub fn throttle(&self, i: usize, rate: &str, down: &str) -> Result<(), String> {
        sh(&[
            "ip",
            "netns",
            "exec",
            &self.ns(i),
            "tc",
            "qdisc",
            "add",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "64kb",
            "latency",
            "50ms",
        ])?;
        sh(&[
            "ip",
            "netns",
            "exec",
            &self.hub(),
            "tc",
            "qdisc",
            "add",
            "dev",
            &self.outer_if(i),
            "root",
            "tbf",
            "rate",
            down,
            "burst",
            "64kb",
            "latency",
            "50ms",
        ])
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 0..self.hosts {
            let _ = sh(&["ip", "netns", "del", &self.ns(i)]);
        }
        for ns in &self.extra {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
        let _ = sh(&["ip", "netns", "del", &self.hub()]);
    }
}

/// A child process killed (and reaped) on drop.
pub struct Killer(pub Child);

impl Drop for Killer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Where a node's log goes: nowhere, unless `RUST_LOG` is set to debug a test.
fn node_stderr() -> Stdio {
    if std::env::var_os("RUST_LOG").is_some() {
        Stdio::inherit()
    } else {
        Stdio::null()
    }
}

/// Starts `starling node` with `args` through `cmd` (typically [`Net::command`]`(i, BIN)`)
/// and waits for its first dialable address (`listening on ...`). Returns the process, the
/// address and the rest of its stdout.
pub fn start_node(
    mut cmd: Command,
    args: &[&str],
) -> (Killer, String, Lines<BufReader<ChildStdout>>) {
    let mut child = cmd
        .arg("node")
        .args(args)
        .args(["--status-interval", "3600"])
        .stdout(Stdio::piped())
        .stderr(node_stderr())
        .spawn()
        .expect("starling node starts");
    let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("the node printed its address")
            .expect("readable stdout");
        if let Some(a) = line.strip_prefix("listening on ") {
            break a.to_string();
        }
    };
    (Killer(child), addr, lines)
}

/// A process's output lines, read on their own thread, so that a test can wait for a line with
/// a deadline instead of blocking on a silent process.
pub struct Watch {
    rx: mpsc::Receiver<String>,
    /// Every line received so far.
    pub seen: Vec<String>,
}

impl Watch {
    /// Starts reading `lines` (such as [`start_node`]'s) on a thread.
    pub fn new(lines: impl Iterator<Item = std::io::Result<String>> + Send + 'static) -> Watch {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Watch {
            rx,
            seen: Vec::new(),
        }
    }

    /// The first line so far, or arriving before `deadline`, that contains `pattern`; `None`
    /// if none does by then (or the process closed its output).
    pub fn wait_for(&mut self, pattern: &str, deadline: Instant) -> Option<String> {
        if let Some(l) = self.seen.iter().find(|l| l.contains(pattern)) {
            return Some(l.clone());
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.rx.recv_timeout(left).ok()?;
            self.seen.push(line.clone());
            if line.contains(pattern) {
                return Some(line);
            }
        }
    }

    /// Takes every line that has arrived without waiting.
    pub fn drain(&mut self) {
        while let Ok(line) = self.rx.try_recv() {
            self.seen.push(line);
        }
    }
}

/// The number after `"name":` in a JSON line.
pub fn field(line: &str, name: &str) -> f64 {
    let key = format!("\"{name}\":");
    let start = line
        .find(&key)
        .unwrap_or_else(|| panic!("{name} missing in {line}"))
        + key.len();
    let rest = &line[start..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end]
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{name} in {line}: {e}"))
}
