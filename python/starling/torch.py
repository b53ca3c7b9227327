"""Train a PyTorch model with a Starling swarm: a collaborative optimizer shaped like
hivemind's ``Optimizer``, so that moving a hivemind script over changes a few lines.

Example (every peer runs the same script; the first without ``initial_peers``)::

    import torch, starling, starling.torch

    node = starling.Node(initial_peers=peers)
    model = torch.nn.Linear(16, 1)
    opt = starling.torch.Optimizer(
        node=node, run_id="my-run", params=model.parameters(),
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        batch_size_per_step=32, target_batch_size=256,
    )
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()          # accumulates; averages and steps once the swarm has 256 samples

How it works. The parameters and gradients live in two flat float32 buffers owned by Starling
(``_native.CollaborativeOptimizer``). **CPU tensors share them**: each parameter's ``.data``
and ``.grad`` become views into the buffers, so ``backward()`` writes gradients straight into
what the averager sends, and the step writes parameters straight into the model: no copies.
**CUDA tensors are staged** through the host buffers: ``step`` copies the gradients to host
memory before averaging and the parameters back to the device after; the host buffers are
page-locked in place (``cudaHostRegister``) so that each copy is one DMA transfer (pageable
copies where that fails; ``staging`` says which applies). The optimizer math is Starling's flat AdamW or SGD, defined as
PyTorch's and written so that the same inputs give the same bits on every peer: with codec
``none`` every peer holds bit-identical parameters after every global step. A
``torch.optim`` optimizer passed in only supplies hyper-parameters (it never steps).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import numpy as np
import torch

from . import _native


def _pin(buffer: torch.Tensor) -> bool:
    """Page-locks a CPU tensor's memory in place (``cudaHostRegister``), so that copies between
    it and CUDA tensors are direct DMA transfers that may run asynchronously. False (and the
    buffer stays pageable) when CUDA is unavailable or the call fails."""
    if not torch.cuda.is_available() or buffer.numel() == 0:
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(
            buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0
        )
    except (RuntimeError, AttributeError):
        return False
    return int(getattr(err, "value", err)) == 0


def _unpin(buffer: torch.Tensor) -> None:
    """Undoes :func:`_pin`."""
    try:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    except (RuntimeError, AttributeError):
        pass

__all__ = ["Optimizer"]


def _hyper_from(optimizer: Any, params: List[torch.Tensor], hyper: Dict[str, Any]) -> Dict[str, Any]:
    """Starling's optimizer hyper-parameters from a name, a torch optimizer, or a factory."""
    out = {
        "kind": "adamw",
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.01,
        "momentum": 0.0,
        "dampening": 0.0,
        "nesterov": False,
    }
    if callable(optimizer) and not isinstance(optimizer, (str, torch.optim.Optimizer)):
        optimizer = optimizer(params)  # hivemind's style: lambda params: torch.optim.Adam(params)
    if isinstance(optimizer, str):
        kind = optimizer.lower()
        if kind not in ("adamw", "adam", "sgd", "sign"):
            raise ValueError(f"optimizer {optimizer!r}: 'adamw', 'adam', 'sgd' or 'sign'")
        out["kind"] = kind if kind in ("sgd", "sign") else "adamw"
        if kind in ("adam", "sgd", "sign"):
            out["weight_decay"] = 0.0
        unknown = set(hyper) - set(out) - {"kind"}
        if unknown:
            raise TypeError(f"unknown optimizer arguments: {sorted(unknown)}")
        out.update(hyper)
        out["betas"] = tuple(float(b) for b in out["betas"])
        return out
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer: a name ('adamw', 'sgd'), a torch.optim optimizer or a factory of one, "
            f"not {type(optimizer).__name__}"
        )
    if hyper:
        raise TypeError("pass hyper-parameters in the torch optimizer, not as arguments too")
    groups = optimizer.param_groups
    keys = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")
    first = {k: groups[0].get(k) for k in keys}
    for g in groups[1:]:
        if {k: g.get(k) for k in keys} != first:
            raise ValueError("parameter groups with different hyper-parameters are not supported")
    g = groups[0]
    for flag in ("amsgrad", "maximize", "differentiable"):
        if g.get(flag):
            raise ValueError(f"{type(optimizer).__name__}({flag}=True) is not supported")
    lr = float(g["lr"])
    if isinstance(optimizer, torch.optim.AdamW):
        out.update(kind="adamw", lr=lr, betas=tuple(map(float, g["betas"])), eps=float(g["eps"]),
                   weight_decay=float(g["weight_decay"]))
    elif isinstance(optimizer, torch.optim.Adam):
        if g["weight_decay"]:
            raise ValueError("torch.optim.Adam's weight_decay is an L2 term; use AdamW (decoupled)")
        out.update(kind="adamw", lr=lr, betas=tuple(map(float, g["betas"])), eps=float(g["eps"]),
                   weight_decay=0.0)
    elif isinstance(optimizer, torch.optim.SGD):
        out.update(kind="sgd", lr=lr, momentum=float(g["momentum"]), dampening=float(g["dampening"]),
                   nesterov=bool(g["nesterov"]), weight_decay=float(g["weight_decay"]))
    else:
        raise ValueError(f"{type(optimizer).__name__}: Starling steps with AdamW, Adam or SGD")
    return out


class Optimizer:
    """A collaborative optimizer over a PyTorch model's parameters (see the module docs).

    Args:
        node: the :class:`starling.Node` to train on.
        run_id: the run's name; peers with the same name train together.
        params: the model's parameters (float32, leaf tensors, on CPU or CUDA).
        optimizer: ``"adamw"``/``"adam"``/``"sgd"``/``"sign"`` (with ``**hyper``: ``lr``,
            ``betas``, ``eps``, ``weight_decay``, ``momentum``, ``dampening``, ``nesterov``;
            ``"sign"`` steps by the sign of the direction, with ``codec="dct-topk:C:K:momentum=B"``
            it is DeMo), a
            ``torch.optim`` AdamW/Adam/SGD, or a factory ``lambda params: ...`` of one.
        batch_size_per_step: samples per ``step()`` (the default for ``step``'s argument).
        target_batch_size: the global batch: samples the swarm gathers per global step.
        mode: ``"gradients"`` (average the global batch's gradients, one shared step) or
            ``"diloco"`` (``inner_steps`` local steps, then average the parameter deltas and
            take an outer Nesterov step with ``outer_lr``/``outer_momentum``).
        codec: the averaging codec (``none`` keeps peers bit-identical; ``f16``, ``u8``, ...),
            or a gradient compressor that keeps them bit-identical too: ``powersgd:RANK[:bf16][:momentum=B]``
            (low-rank matrices) or ``dct-topk:CHUNK:K[:sign][:momentum=B]`` (K of every CHUNK
            DCT coefficients); ``B < 1`` keeps what was not sent as a decaying momentum.
        aggregation: ``mean``, ``median``, ``trimmed-mean`` or ``centered-clip`` (with
            ``reject=2``, ``centered-clip:reject=2``, contributions far from the others are
            left out).
        worker_momentum: gradient mode: each peer averages the momentum of its gradients with
            this factor instead of the gradients (give the optimizer no momentum of its own);
            with ``aggregation="centered-clip:reject=2"`` a peer that sends the opposite of its
            gradient is left out. ``None``: off.
        matchmaking_time, averaging_timeout: seconds.
        target_group_size: peers per averaging group.
        projected_batch: gradient mode: stop accumulating when the swarm's samples, the others'
            projected from their rates, reach the target (each peer computes about its share).
            ``False``: only reported samples count, for peers that each compute an exact share
            and then wait with :meth:`try_step` (reproducible runs).
        load_state_from_peers: download the run's state at start (a late joiner), within
            ``sync_timeout`` seconds; a run's first peer finds no donor and keeps its values.
    """

    def __init__(
        self,
        *,
        node: "_native.Node",
        run_id: str,
        params: Iterable[torch.Tensor],
        optimizer: Union[str, torch.optim.Optimizer, Callable[..., torch.optim.Optimizer]] = "adamw",
        batch_size_per_step: int,
        target_batch_size: int,
        mode: str = "gradients",
        inner_steps: int = 10,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        codec: str = "none",
        aggregation: str = "mean",
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 15.0,
        target_group_size: int = 16,
        projected_batch: bool = True,
        worker_momentum: Optional[float] = None,
        load_state_from_peers: bool = True,
        sync_timeout: float = 60.0,
        **hyper: Any,
    ) -> None:
        self.params: List[torch.Tensor] = list(params)
        if not self.params:
            raise ValueError("params is empty")
        for i, p in enumerate(self.params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameter {i}: a {type(p).__name__}, not a tensor")
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {i}: dtype {p.dtype}, Starling trains float32")
            if not p.is_leaf:
                raise ValueError(f"parameter {i}: not a leaf tensor")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"parameter {i}: device {p.device} (CPU or CUDA only)")
        if batch_size_per_step < 1:
            raise ValueError("batch_size_per_step must be at least 1")
        self.batch_size_per_step = int(batch_size_per_step)
        self.run_id = run_id
        self.mode = mode
        self.sync_timeout = float(sync_timeout)
        self._native = _native.CollaborativeOptimizer(
            node,
            run_id,
            [list(p.shape) for p in self.params],
            _hyper_from(optimizer, self.params, hyper),
            {
                "target_batch_size": int(target_batch_size),
                "mode": mode,
                "inner_steps": int(inner_steps),
                "outer_lr": float(outer_lr),
                "outer_momentum": float(outer_momentum),
                "codec": codec,
                "aggregation": aggregation,
                "matchmaking_time": float(matchmaking_time),
                "averaging_timeout": float(averaging_timeout),
                "target_group_size": int(target_group_size),
                "projected_batch": bool(projected_batch),
                "worker_momentum": None if worker_momentum is None else float(worker_momentum),
            },
        )
        # numpy views of Starling's buffers (they keep the native object alive), as tensors.
        self._flat_params = torch.from_numpy(np.asarray(self._native.params_buffer()))
        self._flat_grads = torch.from_numpy(np.asarray(self._native.grads_buffer()))
        self._views = []
        self._staged = []
        with torch.no_grad():
            for p, (off, n) in zip(self.params, self._native.ranges):
                vp = self._flat_params[off : off + n].view(p.shape)
                vg = self._flat_grads[off : off + n].view(p.shape)
                vp.copy_(p.detach().to("cpu"))
                if p.device.type == "cpu":
                    p.data = vp
                    p.grad = vg
                else:
                    self._staged.append(p)
                self._views.append((p, vp, vg))
        # CUDA tensors: the host buffers are page-locked in place (cudaHostRegister), so that
        # the copies each way are single DMA transfers; where that fails, pageable copies.
        self._pinned: List[torch.Tensor] = []
        if self._staged:
            self._pinned = [b for b in (self._flat_params, self._flat_grads) if _pin(b)]
        if not self._staged:
            self.staging = "none: CPU tensors share Starling's buffers"
        elif len(self._pinned) == 2:
            self.staging = "pinned host buffers (cudaHostRegister) for CUDA tensors"
        else:
            self.staging = "pageable host copies for CUDA tensors (pinning the buffers failed)"
        if load_state_from_peers:
            self.load_state_from_peers(timeout=sync_timeout)
        self._native.serve_state()

    @property
    def epoch(self) -> int:
        """Global steps the run has taken (hivemind's ``local_epoch``)."""
        return self._native.epoch

    local_epoch = epoch

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeroes the gradients in place (they stay Starling's buffers; ``set_to_none`` is
        accepted for compatibility and ignored)."""
        del set_to_none
        self._flat_grads.zero_()
        for p in self._staged:
            if p.grad is not None:
                p.grad.zero_()

    def _gather_grads(self) -> None:
        """Puts every gradient into the flat buffer: staged ones are copied; a CPU gradient
        that is not the buffer's view (``model.zero_grad()`` set it to None, backward made a
        new one) is copied and the view attached again."""
        for i, (p, vp, vg) in enumerate(self._views):
            if p.device.type == "cpu" and p.data_ptr() != vp.data_ptr():
                raise RuntimeError(
                    f"parameter {i} no longer lives in Starling's buffer (moved or replaced after "
                    "the optimizer was made): make the optimizer after model.to(...)"
                )
            g = p.grad
            if g is None:
                vg.zero_()
            elif g.data_ptr() != vg.data_ptr():
                # (From a CUDA tensor straight into the host buffer: one transfer, asynchronous
                # when the buffer is pinned, awaited below before anything reads it.)
                vg.copy_(g.detach(), non_blocking=bool(self._pinned))
                if p.device.type == "cpu":
                    p.grad = vg
        if self._pinned:
            torch.cuda.synchronize()

    def _scatter_params(self) -> None:
        """Copies the parameters back to CUDA tensors (CPU ones already are the buffer). From
        pinned buffers the copies run asynchronously and are awaited once, at the end: the host
        buffer must not change under them."""
        with torch.no_grad():
            for p, vp, _ in self._views:
                if p.device.type != "cpu":
                    p.copy_(vp, non_blocking=bool(self._pinned))
        if self._pinned:
            torch.cuda.synchronize()

    def step(self, batch_size: Optional[int] = None) -> "_native.StepReport":
        """Takes the current gradients (the mean over ``batch_size`` samples, default
        ``batch_size_per_step``); steps when the swarm has its global batch. Returns a
        :class:`starling.StepReport` (``stepped``, ``epoch``, ``group_size``, ``errors``)."""
        self._gather_grads()
        report = self._native.step(int(batch_size or self.batch_size_per_step))
        # (DiLoCo changes the parameters at every step, not only at global ones.)
        return self._after_step(report, scatter=True)

    def try_step(self) -> "_native.StepReport":
        """Gradient mode, for a peer with no more batches this epoch (e.g. each peer computing
        exactly one batch per global step, with ``projected_batch=False``): takes the global
        step if the swarm has its batch, adding no samples, and returns at once either way.
        Call it again after a short pause until ``stepped``::

            report = opt.step()
            while not report.stepped:
                time.sleep(0.005)
                report = opt.try_step()
        """
        report = self._native.try_step()
        return self._after_step(report, scatter=report.stepped)

    def _after_step(self, report: "_native.StepReport", scatter: bool) -> "_native.StepReport":
        """Copies changed parameters back to CUDA tensors; and when the step found this peer
        behind the swarm (a long pause, a lost round, a synced state that was already an epoch
        old, or a round that met the others in a later epoch) without stepping, catches up by
        state sync, as `starling train` does."""
        if self._staged and scatter:
            self._scatter_params()
        if report.behind and not report.stepped:
            try:
                self.load_state_from_peers(timeout=self.sync_timeout, min_epoch=report.sync_floor)
            except _native.StarlingError:
                pass  # retried at the next call; training goes on from the local values
        return report

    def load_state_from_peers(
        self, timeout: float = 60.0, min_epoch: Optional[int] = None
    ) -> Optional[int]:
        """Downloads the run's parameters, optimizer state and epoch from peers; returns the
        epoch, or None when no peer serves the run yet. With ``min_epoch``, only a state of at
        least that epoch is taken (donors still serving an older one are waited for)."""
        epoch = self._native.load_state_from_peers(timeout, min_epoch)
        if self._staged:
            self._scatter_params()
        return epoch

    def report_loss(self, loss: float) -> None:
        """Reports the latest training loss (metrics, dashboard, heartbeat)."""
        self._native.report_loss(float(loss))

    def state_dict(self) -> Dict[str, Any]:
        """The optimizer's state (epoch, optimizer steps and moments) for a checkpoint; the
        parameters are the model's (``model.state_dict()``)."""
        epoch, kind, steps, buffers = self._native.state()
        return {
            "epoch": epoch,
            "optimizer": kind,
            "steps": steps,
            "state": {name: np.frombuffer(b, dtype="<f4").copy() for name, b in buffers},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` (load the model's parameters first)."""
        with torch.no_grad():
            for p, vp, _ in self._views:
                if p.device.type != "cpu" or p.data_ptr() != vp.data_ptr():
                    vp.copy_(p.detach().to("cpu"))
        buffers = [
            (name, np.ascontiguousarray(v, dtype="<f4").tobytes()) for name, v in state["state"].items()
        ]
        self._native.load_state(int(state["epoch"]), int(state["steps"]), buffers)

    def shutdown(self) -> None:
        """Leaves the run (the node keeps running). Idempotent."""
        self._native.shutdown()
        while self._pinned:
            _unpin(self._pinned.pop())

    def __del__(self) -> None:
        # Page-locked memory must be released while the buffers still exist (they do: this
        # object holds them until it is gone).
        for b in getattr(self, "_pinned", []):
            _unpin(b)

    def __enter__(self) -> "Optimizer":
        return self

    def __exit__(self, *args: Any) -> bool:
        self.shutdown()
        return False
