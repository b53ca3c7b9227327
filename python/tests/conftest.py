"""Shared fixtures: nodes on 127.0.0.1 that shut down after each test."""

import contextlib

import pytest

import starling

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def swarm():
    """A factory of nodes joined to the first one made; all shut down afterwards."""
    nodes = []

    def make(**kwargs):
        kwargs.setdefault("listen", LOOPBACK)
        kwargs.setdefault("request_timeout", 5.0)
        if nodes and "initial_peers" not in kwargs:
            kwargs["initial_peers"] = [nodes[0].addresses[0]]
        node = starling.Node(**kwargs)
        nodes.append(node)
        return node

    yield make
    for n in nodes:
        with contextlib.suppress(starling.StarlingError):
            n.shutdown()
