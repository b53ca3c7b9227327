#!/usr/bin/env python3
"""Churn for `starling train`: separate processes, SIGKILL at random times, restarts.

What a volunteer swarm does to a run, on one machine (127.0.0.1), with the digits MLP:

  kill-one  a creator, two joiners and a fourth joiner with a checkpoint directory; the fourth is
            killed with SIGKILL at a random time in [--kill-min, --kill-max] s and restarted
            --restart-after s later from its checkpoint. Every process must finish the run's last
            epoch, and all of them must end with bit-identical parameters (codec none).
  creator   a creator and three joiners; the creator is killed at a random time; a new peer is
            started afterwards with a live joiner's address as --bootstrap. Every live process
            must finish, the newcomer included.
  churn     --peers processes; one (any, the creator too) is killed every --every-min to
            --every-max s and restarted --restart-after s later (every second restart from its
            checkpoint, the others fresh) for --duration s; then the run goes to its end. Also
            runs the same swarm without churn (--baseline) and reports steps per second and the
            final test accuracy of both.

Each scenario runs --runs times. The summary is one JSON object on stdout; a failed check names
the process and what went wrong, and the exit code is 1. Logs of every process are kept in --out.

  scripts/chaos.py kill-one --runs 20
  scripts/chaos.py creator --runs 10
  scripts/chaos.py churn --peers 8 --duration 180 --epochs 3000 --baseline
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

LISTEN = "/ip4/127.0.0.1/tcp/0"


class Peer:
    """One `starling train` process, its JSON lines in a file."""

    def __init__(self, args, name, extra, checkpoint=None):
        self.name = name
        self.args = args
        self.extra = extra
        self.checkpoint = checkpoint
        self.generation = 0
        self.proc = None
        self.out = None
        self.start()

    def start(self, from_checkpoint=True, bootstrap=None):
        self.generation += 1
        path = os.path.join(self.args.out, f"{self.name}.{self.generation}")
        self.out = path + ".jsonl"
        cmd = [self.args.bin, "train", "--listen", LISTEN, "--json"] + self.extra
        if bootstrap is not None:
            # A restarted peer joins through whoever is alive now.
            cmd = [c for c in cmd]
            i = cmd.index("--bootstrap") if "--bootstrap" in cmd else -1
            if i >= 0:
                cmd[i + 1] = bootstrap
            else:
                cmd += ["--bootstrap", bootstrap]
        if self.checkpoint is not None and from_checkpoint:
            cmd += ["--checkpoint-dir", self.checkpoint, "--checkpoint-every", "20"]
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd,
            stdout=open(self.out, "w"),
            stderr=open(path + ".err", "w"),
            stdin=subprocess.DEVNULL,
        )
        self.started = time.time()

    def events(self, kind=None):
        try:
            with open(self.out) as f:
                lines = f.readlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                v = json.loads(line)
            except ValueError:
                continue
            if kind is None or v.get("event") == kind:
                out.append(v)
        return out

    def address(self, timeout=60):
        end = time.time() + timeout
        while time.time() < end:
            for v in self.events("node"):
                return v["listen"][0], v["peer_id"]
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: no node line ({self.err_tail()})")

    def epoch(self):
        steps = self.events("step")
        return steps[-1]["epoch"] if steps else 0

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def alive(self):
        return self.proc.poll() is None

    def err_tail(self):
        try:
            with open(self.out[: -len(".jsonl")] + ".err") as f:
                return f.read()[-600:]
        except OSError:
            return ""

    def wait(self, timeout):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        return self.proc.returncode


def new_run_args(args, run):
    return [
        "--new-run", run, "--model", "mlp", "--epochs", str(args.epochs), "--seed",
        str(args.seed), "--codec", "none",
    ]


def finish_all(peers, limit):
    """Waits for every live peer; returns {name: finished event or an error string}."""
    results = {}
    end = time.time() + limit
    for p in peers:
        rc = p.wait(max(1, end - time.time()))
        fin = p.events("finished")
        if rc == 0 and len(fin) == 1:
            results[p.name] = fin[0]
        else:
            results[p.name] = f"exit {rc}; {p.err_tail()}"
    return results


def check_same_end(results, epochs, failures, identical=True):
    digests = {}
    for name, r in results.items():
        if isinstance(r, str):
            failures.append(f"{name}: did not finish: {r}")
            continue
        if r["epoch"] != epochs:
            failures.append(f"{name}: ended at epoch {r['epoch']}, not {epochs}")
        digests[name] = r.get("params_sha256")
    if identical and len(set(digests.values())) > 1:
        failures.append(f"parameters differ: {digests}")
    return digests


def kill_one(args, run_no, rng):
    run = f"k{run_no}-{os.getpid()}"
    ckpt = tempfile.mkdtemp(prefix="chaos-ckpt-", dir=args.out)
    creator = Peer(args, f"{run}-creator", new_run_args(args, run))
    addr, pid = creator.address()
    join = ["--run", f"{run}@{pid}", "--bootstrap", addr]
    peers = [creator, Peer(args, f"{run}-j1", join), Peer(args, f"{run}-j2", join)]
    victim = Peer(args, f"{run}-j3", join, checkpoint=ckpt)
    peers.append(victim)
    at = rng.uniform(args.kill_min, args.kill_max)
    time.sleep(max(0, victim.started + at - time.time()))
    killed_epoch = victim.epoch()
    victim.kill()
    time.sleep(args.restart_after)
    victim.start(from_checkpoint=True)
    results = finish_all(peers, args.limit)
    failures = []
    check_same_end(results, args.epochs, failures)
    resumed = victim.events("resumed")
    return {
        "scenario": "kill-one",
        "run": run_no,
        "kill_at_s": round(at, 2),
        "killed_at_epoch": killed_epoch,
        "restart_resumed_from": resumed[0]["epoch"] if resumed else None,
        "restart_synced_to": [e["epoch"] for e in victim.events("synced")],
        "epochs": {n: (r if isinstance(r, str) else r["epoch"]) for n, r in results.items()},
        "accuracy": {n: r["test_accuracy"] for n, r in results.items() if not isinstance(r, str)},
        "failures": failures,
    }


def creator_killed(args, run_no, rng):
    run = f"c{run_no}-{os.getpid()}"
    creator = Peer(args, f"{run}-creator", new_run_args(args, run))
    addr, pid = creator.address()
    join = ["--run", f"{run}@{pid}", "--bootstrap", addr]
    joiners = [Peer(args, f"{run}-j{i}", join) for i in (1, 2, 3)]
    at = rng.uniform(args.kill_min, args.kill_max)
    time.sleep(max(0, creator.started + at - time.time()))
    killed_epoch = creator.epoch()
    creator.kill()
    time.sleep(args.restart_after)
    live_addr, _ = joiners[0].address()
    newcomer = Peer(args, f"{run}-newcomer", ["--run", f"{run}@{pid}", "--bootstrap", live_addr])
    results = finish_all(joiners + [newcomer], args.limit)
    failures = []
    check_same_end(results, args.epochs, failures, identical=False)
    return {
        "scenario": "creator",
        "run": run_no,
        "kill_at_s": round(at, 2),
        "killed_at_epoch": killed_epoch,
        "newcomer_synced_to": [e["epoch"] for e in newcomer.events("synced")],
        "epochs": {n: (r if isinstance(r, str) else r["epoch"]) for n, r in results.items()},
        "accuracy": {n: r["test_accuracy"] for n, r in results.items() if not isinstance(r, str)},
        "failures": failures,
    }


def churn(args, run_no, rng, with_churn=True):
    run = f"{'u' if with_churn else 'b'}{run_no}-{os.getpid()}"
    ckpts = [tempfile.mkdtemp(prefix="chaos-ckpt-", dir=args.out) for _ in range(args.peers)]
    creator = Peer(args, f"{run}-p0", new_run_args(args, run), checkpoint=ckpts[0])
    addr, pid = creator.address()
    peers = [creator] + [
        Peer(args, f"{run}-p{i}", ["--run", f"{run}@{pid}", "--bootstrap", addr], checkpoint=ckpts[i])
        for i in range(1, args.peers)
    ]
    began = time.time()
    kills = restarts = 0
    if with_churn:
        while time.time() - began < args.duration:
            time.sleep(rng.uniform(args.every_min, args.every_max))
            live = [p for p in peers if p.alive()]
            if len(live) < 2:
                break
            victim = rng.choice(live)
            victim.kill()
            kills += 1
            time.sleep(args.restart_after)
            others = [p for p in peers if p.alive() and p is not victim]
            if not others:
                break
            boot, _ = rng.choice(others).address()
            victim.start(from_checkpoint=(kills % 2 == 0), bootstrap=boot)
            restarts += 1
    else:
        # The same window without kills, so that both rates cover the same stretch of the run.
        while time.time() - began < args.duration and any(p.alive() for p in peers):
            time.sleep(0.5)
    epochs_at_end_of_churn = max(p.epoch() for p in peers)
    churn_seconds = time.time() - began
    results = finish_all(peers, args.limit)
    failures = []
    check_same_end(results, args.epochs, failures, identical=False)
    acc = [r["test_accuracy"] for r in results.values() if not isinstance(r, str)]
    return {
        "scenario": "churn" if with_churn else "baseline",
        "run": run_no,
        "peers": args.peers,
        "kills": kills,
        "restarts": restarts,
        "epochs_per_second_during": round(epochs_at_end_of_churn / max(churn_seconds, 1e-9), 3),
        "seconds_to_end": round(time.time() - began, 1),
        "epochs_per_second_overall": round(args.epochs / max(time.time() - began, 1e-9), 3),
        "mean_test_accuracy": round(sum(acc) / len(acc), 4) if acc else None,
        "epochs": {n: (r if isinstance(r, str) else r["epoch"]) for n, r in results.items()},
        "failures": failures,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=["kill-one", "creator", "churn"])
    ap.add_argument("--bin", default=os.environ.get("STARLING_BIN", "target/release/starling"))
    ap.add_argument("--runs", type=int, default=1)
    # Long enough that a peer killed up to --kill-max s in and restarted --restart-after s
    # later finds the run still going: the others no longer stall when a peer dies, and at
    # 1500 epochs they often finished (about 20 s here) before the restart.
    ap.add_argument("--epochs", type=int, default=3000)
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--kill-min", type=float, default=2.0)
    ap.add_argument("--kill-max", type=float, default=20.0)
    ap.add_argument("--restart-after", type=float, default=5.0)
    ap.add_argument("--every-min", type=float, default=5.0)
    ap.add_argument("--every-max", type=float, default=10.0)
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--baseline", action="store_true", help="churn: also run without churn")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds a process may take")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None, help="where logs go (default: a new temp dir)")
    args = ap.parse_args()
    args.out = args.out or tempfile.mkdtemp(prefix="starling-chaos-")
    os.makedirs(args.out, exist_ok=True)
    if not os.access(args.bin, os.X_OK):
        sys.exit(f"no starling binary at {args.bin} (cargo build --release, or --bin PATH)")
    rng = random.Random(args.seed)
    reports = []
    for n in range(args.runs):
        if args.scenario == "kill-one":
            r = kill_one(args, n, rng)
        elif args.scenario == "creator":
            r = creator_killed(args, n, rng)
        else:
            r = churn(args, n, rng)
            if args.baseline:
                reports.append(r)
                print(json.dumps(r), file=sys.stderr)
                r = churn(args, n, rng, with_churn=False)
        reports.append(r)
        print(json.dumps(r), file=sys.stderr)
    failed = [r for r in reports if r["failures"]]
    print(json.dumps({"scenario": args.scenario, "runs": len(reports), "failed": len(failed),
                      "logs": args.out, "reports": reports}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
