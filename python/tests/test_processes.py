"""Four Python processes average numpy arrays of 10^6 and 10^7 float32 (codec none): every
process ends with the exact weighted mean and the same bits."""

import json
import os
import subprocess
import sys

import pytest

PEER = os.path.join(os.path.dirname(__file__), "peer.py")


def average_in_processes(peers, size):
    procs = []
    try:
        first = subprocess.Popen(
            [sys.executable, PEER, "0", str(peers), str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(first)
        address = json.loads(first.stdout.readline())["address"]
        for i in range(1, peers):
            procs.append(
                subprocess.Popen(
                    [sys.executable, PEER, str(i), str(peers), str(size), address],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs[1:]:
            json.loads(p.stdout.readline())  # its address: it has started
        results = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.stdin.close()
        for p in procs:
            assert p.wait(timeout=60) == 0
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("size", [10**6, 10**7])
def test_four_processes_hold_the_exact_weighted_mean_with_the_same_bits(size):
    results = average_in_processes(4, size)
    for r in results:
        assert r["group_size"] == 4 and r["averaged_fraction"] == 1.0, r
        assert r["max_err"] <= 1e-6, r
    assert len({r["sha"] for r in results}) == 1, "processes hold different bits"
    print("round seconds per process:", [round(r["seconds"], 3) for r in results])
