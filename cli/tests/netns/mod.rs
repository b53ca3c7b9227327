//! Test hosts with real links: network namespaces joined by a bridge, for tests that run
//! `starling` processes as separate machines would (addresses, lanes, NAT, throttled links).
//!
//! Each test builds its own namespaces (names and a /24 subnet derived from its pid and a tag)
//! and deletes them on drop, also on failure. Namespaces need root and `ip` (Debian
//! `iproute2`); [`available`] tells whether they can be built, and fails loudly when they
//! cannot while `CI` is set (CI runs as root, so a skip there would hide a broken test).
#![allow(dead_code)] // each test binary uses its own part of this module

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout, Command, Stdio};

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
        .stderr(Stdio::null())
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
