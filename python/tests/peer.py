"""One peer of test_processes: averages a seeded random array with the others and prints a
JSON line about the result. Run as: python peer.py INDEX PEERS SIZE [ADDRESS [ROUNDS]]; with
ROUNDS > 1 it also runs that many more rounds on fresh copies of its data and reports their
median all-reduce time (a warm round, as `starling bench allreduce` reports)."""

import hashlib
import json
import sys
import time

import numpy as np

import starling


def data(i, size):
    return np.random.default_rng(100 + i).standard_normal(size, dtype=np.float32)


def main():
    index, peers, size = (int(a) for a in sys.argv[1:4])
    initial = [a for a in sys.argv[4:5] if a != "-"]
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    node = starling.Node(listen=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial)
    print(json.dumps({"address": node.addresses[0]}), flush=True)
    averager = starling.Averager(
        node, f"py-procs-{size}", target_group_size=peers, min_group_size=peers, matchmaking_time=10
    )
    x = data(index, size)
    started = time.perf_counter()
    report = averager.step([x], weight=float(index + 1), timeout=120)
    seconds = time.perf_counter() - started
    warm = []
    for _ in range(rounds - 1):
        y = data(index, size)
        warm.append(averager.step([y], weight=float(index + 1), timeout=120).allreduce_time)
    want = sum((i + 1) * data(i, size).astype(np.float64) for i in range(peers))
    want /= sum(i + 1 for i in range(peers))
    print(
        json.dumps(
            {
                "max_err": float(np.max(np.abs(x - want))),
                "sha": hashlib.sha256(x.tobytes()).hexdigest(),
                "group_size": report.group_size,
                "averaged_fraction": report.averaged_fraction,
                "seconds": seconds,
                "allreduce": report.allreduce_time,
                "warm_allreduce_median": float(np.median(warm)) if warm else None,
            }
        ),
        flush=True,
    )
    # Stay until every peer has its result: a reducer that leaves early fails the others.
    sys.stdin.read()
    averager.shutdown()
    node.shutdown()


if __name__ == "__main__":
    main()
