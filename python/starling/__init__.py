"""Starling: decentralized peer-to-peer training.

Join a swarm with :class:`Node`, average numpy float32 arrays in place with
:class:`Averager` (butterfly all-reduce in groups) or :class:`GossipAverager`
(pairwise gossip), and train a PyTorch model with ``starling.torch.Optimizer``.

Example (two processes; the second joins through an address the first prints)::

    import numpy as np, starling

    node = starling.Node(listen=["/ip4/0.0.0.0/tcp/0"])      # or initial_peers=[address]
    print(node.addresses)
    averager = starling.Averager(node, prefix="my-run", target_group_size=2)
    grads = [np.random.rand(1000).astype(np.float32)]
    report = averager.step(grads, weight=1.0, timeout=30)   # grads now hold the group's mean
    print(report.group_size, report.averaged_fraction)

Network work runs on a background runtime (two threads per process) with the GIL released,
so other Python threads keep running while a step waits on the network.
"""

from ._native import (
    Averager,
    CollaborativeOptimizer,
    StepReport,
    GossipAverager,
    GossipReport,
    NoGroupError,
    Node,
    NodeClosedError,
    RoundReport,
    SchemaMismatchError,
    StarlingError,
    TimeoutError,
    __version__,
    log_to_stderr,
)

__all__ = [
    "Averager",
    "CollaborativeOptimizer",
    "StepReport",
    "GossipAverager",
    "GossipReport",
    "NoGroupError",
    "Node",
    "NodeClosedError",
    "RoundReport",
    "SchemaMismatchError",
    "StarlingError",
    "TimeoutError",
    "__version__",
    "log_to_stderr",
]
