"""Train a small PyTorch classifier with a Starling swarm, one command per process.

First peer (prints the address the others join through):

    python examples/python/train.py

Every other peer, in its own terminal or on its own machine:

    python examples/python/train.py --join /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID

The data is a synthetic 10-class problem (Gaussian blobs in 32 dimensions), generated from a
seed so that every peer has the same test set; each peer samples its own training batches.
The peers average gradients over a global batch of --target-batch-size samples and take one
shared AdamW step each time: with the default codec every peer holds the same parameters,
which the script checks by printing a fingerprint of them at the end.
"""

import argparse
import hashlib
import time

import torch

import starling
import starling.torch


def blobs(n, seed, classes=10, dim=32):
    """`n` labelled points around `classes` fixed centres (the centres come from seed 0)."""
    centres = torch.randn(classes, dim, generator=torch.Generator().manual_seed(0)) * 2.0
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    return centres[labels] + torch.randn(n, dim, generator=g), labels


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--join", action="append", default=[], help="address of a peer of the swarm")
    ap.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0")
    ap.add_argument("--run-id", default="py-blobs")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--target-batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=30, help="global steps to train for")
    ap.add_argument("--codec", default="none")
    ap.add_argument("--seed", type=int, default=None, help="this peer's sampling seed")
    args = ap.parse_args()

    node = starling.Node(initial_peers=args.join, listen=[args.listen])
    print(f"peer {node.peer_id}; others join with --join {node.addresses[0]}", flush=True)

    torch.manual_seed(1234)  # the same initial model everywhere (a joiner loads the run's anyway)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    )
    opt = starling.torch.Optimizer(
        node=node,
        run_id=args.run_id,
        params=model.parameters(),
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
        batch_size_per_step=args.batch_size,
        target_batch_size=args.target_batch_size,
        codec=args.codec,
    )
    print(f"joined at epoch {opt.epoch}; tensors: {opt.staging}", flush=True)

    test_x, test_y = blobs(2000, seed=1)
    seed = args.seed if args.seed is not None else int.from_bytes(node.peer_id.encode()[-4:], "little")
    g = torch.Generator().manual_seed(seed)
    started = time.time()
    last = -1
    while opt.epoch < args.epochs:
        x, y = blobs(args.batch_size, seed=int(torch.randint(0, 2**31, (1,), generator=g)))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        report = opt.step()
        opt.report_loss(loss.item())
        if report.stepped and opt.epoch != last:
            last = opt.epoch
            with torch.no_grad():
                acc = (model(test_x).argmax(-1) == test_y).float().mean().item()
            errors = f", errors: {report.errors}" if report.errors else ""
            print(
                f"epoch {opt.epoch:3d}  loss {loss.item():.3f}  test accuracy {acc:.3f}  "
                f"group {report.group_size}{errors}",
                flush=True,
            )
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    print(
        f"done in {time.time() - started:.1f} s at epoch {opt.epoch}; "
        f"parameters sha256 {hashlib.sha256(flat.tobytes()).hexdigest()[:16]}",
        flush=True,
    )
    # Serve the final state a little longer so that slower peers can finish their last round.
    time.sleep(3)
    opt.shutdown()
    node.shutdown()


if __name__ == "__main__":
    main()
