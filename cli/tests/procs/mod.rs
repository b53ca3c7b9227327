//! Runs the real `starling` binary from tests: long-running processes whose stdout lines are
//! read as they come, and commands run to completion, all bounded in time.
#![allow(dead_code)] // each test file uses a part

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_starling");
/// Listen on 127.0.0.1, a port the OS picks.
pub const LOOPBACK: &str = "/ip4/127.0.0.1/tcp/0";

/// One multi-process test at a time (each starts several processes on a 2-core machine): hold
/// the guard for the test's length.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A stdout line as JSON, if it is.
pub fn json(line: &str) -> Option<serde_json::Value> {
    serde_json::from_str(line).ok()
}

/// The events of one kind among a process's JSON lines.
pub fn events(lines: &[String], kind: &str) -> Vec<serde_json::Value> {
    lines
        .iter()
        .filter_map(|l| json(l))
        .filter(|v| v["event"] == kind)
        .collect()
}

/// Starts `starling train` with `args` (plus loopback listening and JSON output).
pub fn train(args: &[&str]) -> Proc {
    let mut all = vec!["train", "--listen", LOOPBACK, "--json"];
    all.extend_from_slice(args);
    Proc::spawn(&all)
}

/// A `starling train` process's dialable address and peer id, from its node line.
pub fn address(p: &Proc) -> (String, String) {
    let line = p.wait_for("the node line", Duration::from_secs(60), |l| {
        json(l).is_some_and(|v| v["event"] == "node")
    });
    let v = json(&line).expect("the node line is JSON");
    (
        v["listen"][0].as_str().unwrap_or_default().to_string(),
        v["peer_id"].as_str().unwrap_or_default().to_string(),
    )
}

/// Kills the child on drop so a failing test leaves no process behind.
pub struct Proc {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    /// Every stdout line read so far (also those `wait_for` passed over).
    log: std::cell::RefCell<Vec<String>>,
}

impl Proc {
    pub fn spawn(args: &[&str]) -> Proc {
        let mut child = Command::new(BIN)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starling binary runs");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc {
            child,
            lines,
            log: Default::default(),
        }
    }

    /// Waits (bounded) for a stdout line satisfying `pred`.
    pub fn wait_for(&self, what: &str, limit: Duration, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.log.borrow_mut().push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(_) => panic!("timed out waiting for {what}"),
            }
        }
    }
}

impl Proc {
    /// Waits (bounded) for the process to exit; returns whether it succeeded and every stdout
    /// line it printed.
    pub fn finish(mut self, what: &str, limit: Duration) -> (bool, Vec<String>) {
        let deadline = Instant::now() + limit;
        loop {
            while let Ok(line) = self.lines.try_recv() {
                self.log.borrow_mut().push(line);
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                // The reader thread ends at EOF: take what it still holds.
                while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(2)) {
                    self.log.borrow_mut().push(line);
                }
                return (status.success(), self.log.take());
            }
            assert!(
                Instant::now() < deadline,
                "{what} did not finish in {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `starling args` to completion (at most 60 s).
pub fn run(args: &[&str]) -> std::process::Output {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("starling {args:?} did not finish");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
