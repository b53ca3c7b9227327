//! The real `starling` binary: a private swarm of two node processes that connect and exchange a
//! record through `starling dht put` / `starling dht get`; an expert server found by
//! `starling experts ls`.

mod procs;

use procs::{run, Proc};
use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn two_node_processes_connect_and_exchange_a_record() {
    let dir = tempfile::tempdir().unwrap();
    let swarm = dir.path().join("lab.swarm");
    let swarm = swarm.to_str().unwrap();
    let out = run(&["init-swarm", "--out", swarm]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("fingerprint"));
    // init-swarm refuses to overwrite a key.
    assert!(!run(&["init-swarm", "--out", swarm]).status.success());

    let id_a = dir.path().join("a.key");
    let a = Proc::spawn(&[
        "node",
        "--swarm",
        swarm,
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--identity",
        id_a.to_str().unwrap(),
        "--status-interval",
        "1",
    ]);
    let addr_a = a.wait_for("A's address", Duration::from_secs(30), |l| {
        l.starts_with("listening on ")
    });
    let addr_a = addr_a.trim_start_matches("listening on ").to_string();
    assert!(addr_a.contains("/p2p/"));

    let b = Proc::spawn(&[
        "node",
        "--swarm",
        swarm,
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--bootstrap",
        &addr_a,
        "--status-interval",
        "1",
    ]);
    let addr_b = b.wait_for("B's address", Duration::from_secs(30), |l| {
        l.starts_with("listening on ")
    });
    let addr_b = addr_b.trim_start_matches("listening on ").to_string();
    b.wait_for("B connected to A", Duration::from_secs(30), |l| {
        l.starts_with("peers 1 ")
    });
    a.wait_for("A connected to B", Duration::from_secs(30), |l| {
        l.starts_with("peers 1 ")
    });

    // Write through B, read through A.
    let put = run(&[
        "dht",
        "put",
        "lab.hello",
        "from-b",
        "--subkey",
        "greeting",
        "--ttl",
        "120",
        "--bootstrap",
        &addr_b,
        "--swarm",
        swarm,
    ]);
    assert!(
        put.status.success(),
        "put failed: {}",
        String::from_utf8_lossy(&put.stderr)
    );
    let get = run(&[
        "dht",
        "get",
        "lab.hello",
        "--bootstrap",
        &addr_a,
        "--swarm",
        swarm,
    ]);
    assert!(
        get.status.success(),
        "get failed: {}",
        String::from_utf8_lossy(&get.stderr)
    );
    let text = String::from_utf8_lossy(&get.stdout);
    assert!(
        text.contains("greeting\tfrom-b"),
        "unexpected get output: {text}"
    );

    // Without the key the same commands fail with a clear error.
    let get = run(&[
        "dht",
        "get",
        "lab.hello",
        "--bootstrap",
        &addr_a,
        "--timeout",
        "2",
    ]);
    assert!(!get.status.success());
    assert!(String::from_utf8_lossy(&get.stderr).contains("bootstrap"));
    // A missing key is a non-zero exit too.
    let get = run(&[
        "dht",
        "get",
        "lab.nothing",
        "--bootstrap",
        &addr_a,
        "--swarm",
        swarm,
    ]);
    assert!(!get.status.success());
}

/// `starling experts serve` hosts a grid of experts, `starling experts ls` finds them through the
/// DHT, and SIGTERM stops the server cleanly with a final checkpoint.
#[test]
fn experts_serve_and_ls() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let server = Proc::spawn(&[
        "experts",
        "serve",
        "--uids",
        "ffn.0.[0:4]",
        "--hidden",
        "16",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--status-interval",
        "1",
    ]);
    let addr = server.wait_for("the server's address", Duration::from_secs(30), |l| {
        l.starts_with("listening on ")
    });
    let addr = addr.trim_start_matches("listening on ").to_string();
    let serving = server.wait_for("serving", Duration::from_secs(30), |l| {
        l.starts_with("serving ")
    });
    assert!(
        serving.contains("serving 4 Ffn experts (ffn.0.0 .. ffn.0.3)"),
        "{serving}"
    );
    let mut listing = String::new();
    for _ in 0..20 {
        let ls = run(&[
            "experts",
            "ls",
            "--grid",
            "ffn",
            "--info",
            "--bootstrap",
            &addr,
        ]);
        assert!(
            ls.status.success(),
            "{}",
            String::from_utf8_lossy(&ls.stderr)
        );
        listing = String::from_utf8_lossy(&ls.stdout).to_string();
        if listing.contains("4 live expert(s)") {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(listing.contains("4 live expert(s)"), "{listing}");
    for i in 0..4 {
        assert!(
            listing.contains(&format!("ffn.0.{i}\t"))
                && listing.contains("Ffn dim 16 hidden 64 steps 0"),
            "{listing}"
        );
    }
    // Unknown grid: an empty listing, not an error.
    let ls = run(&["experts", "ls", "--grid", "nothing", "--bootstrap", &addr]);
    assert!(ls.status.success());
    assert!(String::from_utf8_lossy(&ls.stdout).contains("no live experts"));
    // SIGTERM: clean shutdown with a final checkpoint.
    let pid = server.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    server.wait_for("shutdown", Duration::from_secs(30), |l| {
        l.starts_with("shutting down")
    });
    let mut server = server;
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "server did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success());
    for i in 0..4 {
        assert!(ckpt.join(format!("ffn.0.{i}.safetensors")).exists());
    }
}
