"""Type stubs of the compiled module ``starling._native`` (re-exported by ``starling``)."""

from os import PathLike
from typing import Any, List, Optional, Sequence, Tuple, Union

__version__: str

class StarlingError(Exception):
    """Every error Starling raises; the message carries the Rust error's whole cause chain."""

class TimeoutError(StarlingError):
    """A network wait ran out of time (a deadline, a dial, a DHT query)."""

class NoGroupError(StarlingError):
    """No averaging group formed before the deadline (too few peers searched)."""

class SchemaMismatchError(StarlingError):
    """The other peers of the run average other tensor sizes, order or codec."""

class NodeClosedError(StarlingError):
    """The node (or averager) has shut down; every later call raises this."""

def log_to_stderr(level: str = "info") -> None:
    """Send Starling's logs to stderr at ``level`` (or a RUST_LOG-style filter)."""

class Node:
    """A Starling node: libp2p host and DHT, on a background runtime."""

    def __init__(
        self,
        initial_peers: Sequence[str] = ...,
        listen: Optional[Sequence[str]] = None,
        swarm_key: Optional[Union[str, PathLike]] = None,
        identity: Optional[Union[str, PathLike]] = None,
        client: bool = False,
        request_timeout: float = 10.0,
    ) -> None:
        """Start a node: listen (default all interfaces, TCP and QUIC), join through
        ``initial_peers`` (multiaddresses ending in ``/p2p/<peer id>``), with the private swarm
        key file ``swarm_key`` and the identity key file ``identity`` (created if absent)."""
    @property
    def peer_id(self) -> str: ...
    @property
    def addresses(self) -> List[str]:
        """Addresses other peers can join through."""
    @property
    def closed(self) -> bool: ...
    def store(self, key: str, subkey: str, value: bytes, expiration: float = 60.0) -> int:
        """Store ``value`` under ``(key, subkey)`` for ``expiration`` seconds; returns the
        number of peers that acknowledged."""
    def get(self, key: str) -> List[Tuple[str, bytes, float]]:
        """Live entries under ``key``: ``(subkey, value, expires_at_unix_seconds)``."""
    def connected_peers(self) -> List[str]: ...
    def shutdown(self) -> None:
        """Stop the node; later calls raise NodeClosedError. Idempotent."""
    def __enter__(self) -> "Node": ...
    def __exit__(self, *args: Any) -> bool: ...

class RoundReport:
    """What one averaging round did."""

    round_id: int
    group: List[str]
    group_size: int
    my_index: int
    averaged_fraction: float
    failed_peers: List[str]
    bytes_sent: int
    bytes_received: int
    matchmaking_time: float
    allreduce_time: float
    fast_lane_transfers: int

class Averager:
    """Butterfly all-reduce of numpy float32 arrays, in place, with the peers of a run."""

    def __init__(
        self,
        node: Node,
        prefix: str,
        target_group_size: int = 4,
        min_group_size: int = 2,
        matchmaking_time: float = 5.0,
        codec: str = "none",
        aggregation: str = "mean",
        client: bool = False,
        request_timeout: float = 5.0,
        verify: float = 0.0,
    ) -> None:
        """``verify``: probability (0 to 1) of checking one random block of another reducer's
        result after each round; a reducer caught lying is refused by every peer that reads the
        published evidence. Needs ``aggregation`` mean, median or trimmed-mean."""
    @property
    def prefix(self) -> str: ...
    def step(self, tensors: Sequence[Any], weight: float = 1.0, timeout: float = 30.0) -> RoundReport:
        """Average ``tensors`` (numpy float32, C-contiguous, writable) with a group, in place,
        with the GIL released. TypeError/ValueError name a bad array; NoGroupError,
        SchemaMismatchError, TimeoutError, NodeClosedError leave the arrays unchanged."""
    def shutdown(self) -> None: ...
    def __enter__(self) -> "Averager": ...
    def __exit__(self, *args: Any) -> bool: ...

class GossipReport:
    """What one gossip round did."""

    round: int
    members: int
    averaged: int
    failed: int
    served: int
    bytes_sent: int
    bytes_received: int
    duration: float

class GossipAverager:
    """Gossip averaging of numpy float32 arrays, in place."""

    def __init__(
        self,
        node: Node,
        prefix: str,
        codec: str = "none",
        alpha: float = 1.0,
        exchange_timeout: float = 10.0,
    ) -> None: ...
    def step(self, tensors: Sequence[Any], weight: float = 1.0, timeout: float = 30.0) -> GossipReport: ...
    def shutdown(self) -> None: ...

def digits() -> Tuple[bytes, List[int], bytes, List[int]]:
    """The embedded 8x8 digits (see starling.datasets.digits, which returns numpy arrays)."""

class StepReport:
    """What one call of CollaborativeOptimizer.step did."""

    epoch: int
    stepped: bool
    group_size: Optional[int]
    samples: int
    state_checked: bool
    state_averaged: bool
    behind: bool
    swarm_epoch: Optional[int]
    others_epoch: Optional[int]
    sync_floor: int
    errors: List[str]
    waiting: float
    averaging: float
    optimizer: float

class FlatBuffer:
    """A flat float32 buffer of a CollaborativeOptimizer, for numpy.asarray (zero copy)."""

    __array_interface__: dict
    def __len__(self) -> int: ...

class CollaborativeOptimizer:
    """The collaborative optimizer over flat buffers (use starling.torch.Optimizer)."""

    def __init__(
        self, node: Node, run_id: str, shapes: List[List[int]], optimizer: dict, collab: dict
    ) -> None: ...
    @property
    def ranges(self) -> List[Tuple[int, int]]: ...
    @property
    def epoch(self) -> int: ...
    def params_buffer(self) -> FlatBuffer: ...
    def grads_buffer(self) -> FlatBuffer: ...
    def step(self, batch_size: int) -> StepReport: ...
    def try_step(self) -> StepReport: ...
    def serve_state(self) -> None: ...
    def load_state_from_peers(
        self, timeout: float = 60.0, min_epoch: Optional[int] = None
    ) -> Optional[int]: ...
    def report_loss(self, loss: float) -> None: ...
    def state(self) -> Tuple[int, str, int, List[Tuple[str, bytes]]]: ...
    def load_state(self, epoch: int, steps: int, buffers: List[Tuple[str, bytes]]) -> None: ...
    def shutdown(self) -> None: ...
