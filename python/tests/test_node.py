"""starling.Node: start, join, the DHT, shutdown, and errors that name their cause."""

import time

import pytest

import starling


def test_two_nodes_join_and_share_dht_records(swarm):
    a = swarm()
    b = swarm()
    assert a.peer_id != b.peer_id
    assert all(addr.endswith("/p2p/" + a.peer_id) for addr in a.addresses)
    assert b.peer_id in a.connected_peers()
    acks = b.store("py.test.key", "b", b"\x00hello\xff", expiration=30)
    assert acks >= 1
    entries = a.get("py.test.key")
    assert [(s, v) for s, v, _ in entries] == [("b", b"\x00hello\xff")]
    expires = entries[0][2]
    assert time.time() + 20 < expires < time.time() + 40
    assert a.get("py.test.missing") == []


def test_a_closed_node_raises_on_every_call_and_never_hangs(swarm):
    node = swarm()
    node.shutdown()
    node.shutdown()  # idempotent
    assert node.closed
    started = time.monotonic()
    for call in (
        lambda: node.addresses,
        lambda: node.store("k", "s", b"v"),
        lambda: node.get("k"),
        lambda: node.connected_peers(),
        lambda: starling.Averager(node, "run"),
    ):
        with pytest.raises(starling.NodeClosedError):
            call()
    assert time.monotonic() - started < 5
    assert issubclass(starling.NodeClosedError, starling.StarlingError)


def test_the_context_manager_shuts_the_node_down():
    with starling.Node(listen=["/ip4/127.0.0.1/tcp/0"]) as node:
        assert not node.closed
    assert node.closed


def test_bad_arguments_are_value_errors_that_name_them():
    with pytest.raises(ValueError, match="initial peer"):
        starling.Node(initial_peers=["not-an-address"])
    with pytest.raises(ValueError, match="request_timeout"):
        starling.Node(request_timeout=-1)


def test_an_unreachable_initial_peer_is_a_clear_error_not_a_hang():
    started = time.monotonic()
    # A port nobody listens on (the node's own dial is refused at once).
    with pytest.raises(starling.StarlingError, match="bootstrap|dial|answer"):
        starling.Node(
            listen=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=[
                "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWBx7JMYEK5pZSrXpTQgnhSSibVnUZQE9jpu75CjqLybYV"
            ],
            request_timeout=2.0,
        )
    assert time.monotonic() - started < 60
