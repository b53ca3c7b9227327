"""starling.Averager and GossipAverager on numpy arrays: the exact weighted mean, in place,
the same bits on every peer, the GIL released during a round, and bad arrays refused by
name."""

import threading

import numpy as np
import pytest

import starling


def run_together(averagers, tensors, weights, timeout=30.0):
    """Steps every averager at once, each on its own thread; returns reports or exceptions."""
    results = [None] * len(averagers)

    def go(i):
        try:
            results[i] = averagers[i].step(tensors[i], weight=weights[i], timeout=timeout)
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(averagers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_two_peers_hold_the_exact_weighted_mean_in_place_and_the_gil_is_free(swarm):
    a, b = swarm(), swarm()
    avs = [starling.Averager(n, "py-mean", target_group_size=2, min_group_size=2) for n in (a, b)]
    rng = np.random.default_rng(7)
    shapes = [(300, 17), (1,), (4096,)]
    tensors = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(2)]
    weights = [1.0, 3.0]
    want = [
        (weights[0] * x.astype(np.float64) + weights[1] * y.astype(np.float64)) / sum(weights)
        for x, y in zip(*tensors)
    ]
    views = [[t for t in ts] for ts in tensors]  # the same objects: results land in place

    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        reports = run_together(avs, views, weights)
    finally:
        stop.set()
        spinner.join()
    for r in reports:
        assert isinstance(r, starling.RoundReport), r
        assert r.group_size == 2 and r.averaged_fraction == 1.0 and r.failed_peers == []
    for i in range(len(shapes)):
        np.testing.assert_allclose(tensors[0][i], want[i], atol=1e-6, rtol=0)
        assert tensors[0][i].tobytes() == tensors[1][i].tobytes(), "peers differ in bits"
        assert tensors[0][i].shape == shapes[i]
    # Python ran on another thread while both steps waited on the network.
    assert ticks[0] > 1000, ticks[0]
    for av in avs:
        av.shutdown()


def test_bad_arrays_are_refused_by_index_and_left_alone(swarm):
    node = swarm()
    av = starling.Averager(node, "py-bad")
    good = np.ones(8, dtype=np.float32)
    cases = [
        ([good, np.ones(8)], TypeError, "tensor 1: dtype <f8"),
        ([[1.0, 2.0]], TypeError, "tensor 0: a list is not an array"),
        ([np.ones((4, 4), np.float32)[:, ::2]], ValueError, "tensor 0: .*not C-contiguous"),
        ([good, good], ValueError, "tensors 0 and 1 share memory"),
    ]
    ro = np.ones(4, np.float32)
    ro.setflags(write=False)
    cases.append(([good, ro], ValueError, "tensor 1: the array is read-only"))
    for tensors, err, msg in cases:
        with pytest.raises(err, match=msg):
            av.step(tensors, timeout=5)
    assert (good == 1).all()
    with pytest.raises(ValueError, match="weight"):
        av.step([good], weight=float("nan"), timeout=5)
    with pytest.raises(ValueError, match="timeout"):
        av.step([good], timeout=0)
    av.shutdown()
    with pytest.raises(starling.NodeClosedError):
        av.step([good], timeout=5)


def test_a_lone_peer_gets_no_group_and_keeps_its_values(swarm):
    node = swarm()
    av = starling.Averager(node, "py-alone", matchmaking_time=1.0)
    x = np.arange(16, dtype=np.float32)
    with pytest.raises(starling.NoGroupError, match="no group"):
        av.step([x], timeout=10)
    assert (x == np.arange(16, dtype=np.float32)).all()
    av.shutdown()


def test_different_sizes_are_a_schema_mismatch(swarm):
    a, b = swarm(), swarm()
    avs = [starling.Averager(n, "py-schema", matchmaking_time=2.0) for n in (a, b)]
    res = run_together(
        avs, [[np.ones(10, np.float32)], [np.ones(11, np.float32)]], [1.0, 1.0], timeout=10
    )
    assert any(isinstance(r, starling.SchemaMismatchError) for r in res), res
    for av in avs:
        av.shutdown()


def test_gossip_moves_two_peers_to_their_mean(swarm):
    a, b = swarm(), swarm()
    gs = [starling.GossipAverager(n, "py-gossip") for n in (a, b)]
    xs = [np.zeros(1000, np.float32), np.full(1000, 2.0, np.float32)]
    for _ in range(10):
        run_together(gs, [[x] for x in xs], [1.0, 1.0], timeout=15)
        if abs(float(xs[0].mean()) - 1.0) < 1e-6 and abs(float(xs[1].mean()) - 1.0) < 1e-6:
            break
    np.testing.assert_allclose(xs[0], 1.0, atol=1e-6)
    np.testing.assert_allclose(xs[1], 1.0, atol=1e-6)
    for g in gs:
        g.shutdown()
