"""starling.torch.Optimizer: two peers train one PyTorch model and stay bit-identical, a late
joiner loads the run's state, checkpoints round-trip, and bad arguments are refused."""

import os
import threading
import time

import pytest

if os.environ.get("CI"):
    import torch  # CI installs torch: these tests must run there
else:
    torch = pytest.importorskip("torch")

import starling  # noqa: E402
import starling.torch as st  # noqa: E402


def data(seed, n=64, d=8):
    g = torch.Generator().manual_seed(seed)
    w = torch.arange(1.0, d + 1.0) / d
    x = torch.randn(n, d, generator=g)
    return x, x @ w + 0.01 * torch.randn(n, generator=g)


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 1)


def train(opt, net, seed, until_epoch, losses):
    """Trains until the run reaches `until_epoch` (as a real script does, not for a count of
    batches: the group steps together, so every member stops at the same epoch)."""
    x, y = data(seed)
    b = 0
    while opt.epoch < until_epoch:
        b += 1
        time.sleep(0.02)  # a batch's compute: real models take time, and so progress spreads
        xb, yb = x[(b * 16) % 64 :][:16], y[(b * 16) % 64 :][:16]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(xb).squeeze(-1), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())


def make(node, net, run, **kw):
    kw.setdefault("optimizer", torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.0))
    return st.Optimizer(
        node=node,
        run_id=run,
        params=net.parameters(),
        batch_size_per_step=16,
        target_batch_size=32,
        matchmaking_time=2.0,
        averaging_timeout=10.0,
        sync_timeout=10.0,
        **kw,
    )


def test_two_peers_train_one_model_and_stay_bit_identical(swarm):
    a, b = swarm(), swarm()
    nets = [model(), model()]
    opts = [make(a, nets[0], "py-torch")]
    assert opts[0].staging.startswith("none")
    opts.append(make(b, nets[1], "py-torch"))
    # CPU parameters are Starling's buffers: no copies.
    flat = opts[0]._flat_params
    assert nets[0].weight.data_ptr() == flat.data_ptr()
    losses = [[], []]
    threads = [
        threading.Thread(target=train, args=(opts[i], nets[i], 10 + i, 8, losses[i])) for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opts[0].epoch == opts[1].epoch == 8, (opts[0].epoch, opts[1].epoch)
    for pa, pb in zip(nets[0].parameters(), nets[1].parameters()):
        assert pa.detach().numpy().tobytes() == pb.detach().numpy().tobytes(), "peers differ"
    assert losses[0][-1] < losses[0][0] / 4, losses[0]
    # A checkpoint of the optimizer round-trips.
    sd = opts[0].state_dict()
    assert sd["epoch"] == opts[0].epoch and sd["optimizer"] == "adamw" and sd["steps"] == sd["epoch"]
    assert all(v.shape == (9,) for v in sd["state"].values()) and len(sd["state"]) == 2
    opts[0].load_state_dict(sd)
    sd2 = opts[0].state_dict()
    assert sd2["epoch"] == sd["epoch"] and all(
        (sd2["state"][k] == v).all() for k, v in sd["state"].items()
    )
    # A late joiner starts from the run's state, not its own initial values...
    late_net = torch.nn.Linear(8, 1)
    late = make(swarm(), late_net, "py-torch")
    assert late.epoch == opts[0].epoch
    assert late_net.weight.detach().numpy().tobytes() == nets[0].weight.detach().numpy().tobytes()
    # ... and then steps in the same epochs as the others, holding the same bits.
    opts.append(late)
    nets.append(late_net)
    losses = [[], [], []]
    threads = [
        threading.Thread(target=train, args=(opts[i], nets[i], 20 + i, sd["epoch"] + 4, losses[i])) for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [o.epoch for o in opts] == [sd["epoch"] + 4] * 3, [o.epoch for o in opts]
    for ps in zip(*(n.parameters() for n in nets)):
        assert len({p.detach().numpy().tobytes() for p in ps}) == 1, "peers differ after the join"
    for o in opts:
        o.shutdown()


def test_a_sign_step_moves_every_weight_by_the_rate(swarm):
    """optimizer="sign" (DeMo's step, without a compressor here): one step moves every
    parameter by exactly the rate against its gradient's sign."""
    net = model()
    opt = make(swarm(), net, "py-sign", optimizer="sign", lr=0.01)
    x, y = data(3)
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x[:16]).squeeze(-1), y[:16]).backward()
    before = [p.detach().clone() for p in net.parameters()]
    grads = [p.grad.detach().clone() for p in net.parameters()]
    assert all((g != 0).all() for g in grads)
    while opt.epoch < 1:
        opt.step()
    for b, g, p in zip(before, grads, net.parameters()):
        assert torch.equal(p.detach(), b - 0.01 * torch.sign(g)), (p, b, g)
    opt.shutdown()


def test_bad_parameters_and_optimizers_are_refused(swarm):
    node = swarm()
    with pytest.raises(TypeError, match="float32"):
        st.Optimizer(node=node, run_id="r", params=[torch.zeros(3, dtype=torch.float64, requires_grad=True)],
                     batch_size_per_step=1, target_batch_size=1)
    net = model()
    with pytest.raises(ValueError, match="amsgrad"):
        st.Optimizer(node=node, run_id="r", params=net.parameters(),
                     optimizer=torch.optim.AdamW(net.parameters(), amsgrad=True),
                     batch_size_per_step=1, target_batch_size=1)
    with pytest.raises(ValueError, match="optimizer"):
        st.Optimizer(node=node, run_id="r", params=net.parameters(), optimizer="lion",
                     batch_size_per_step=1, target_batch_size=1)
    with pytest.raises(ValueError, match="mode"):
        st.Optimizer(node=node, run_id="r", params=net.parameters(), mode="async",
                     batch_size_per_step=1, target_batch_size=1)
    with pytest.raises(ValueError, match="rank"):
        st.Optimizer(node=node, run_id="r", params=net.parameters(), codec="powersgd:0",
                     batch_size_per_step=1, target_batch_size=1)
    with pytest.raises(ValueError, match="CHUNK"):
        st.Optimizer(node=node, run_id="r", params=net.parameters(), codec="dct-topk:64:65",
                     batch_size_per_step=1, target_batch_size=1)
    with pytest.raises(ValueError, match="worker_momentum"):
        st.Optimizer(node=node, run_id="r", params=net.parameters(), worker_momentum=1.5,
                     batch_size_per_step=1, target_batch_size=1)
    with pytest.raises(ValueError, match="reject"):
        st.Optimizer(node=node, run_id="r", params=net.parameters(),
                     aggregation="centered-clip:reject=0.5",
                     batch_size_per_step=1, target_batch_size=1)
