"""An MLP on the embedded 8x8 digits, trained by a swarm of processes with
``starling.torch.Optimizer``, or by one process alone on the same samples (for comparison).

Four peers on this machine, one command each (the first prints the address to join):

    python examples/python/digits.py --peers 4 --rank 0
    python examples/python/digits.py --peers 4 --rank 1 --join ADDRESS     # ranks 1, 2, 3

A process may also join a run under way (``--late``): it downloads the run's state from the
others and steps in their next epoch.

One process alone on the same samples (each epoch, the batches of all four ranks at once):

    python examples/python/digits.py --peers 4 --alone

Rank ``r``'s ``k``-th batch is drawn with seed ``(k, r)``; the swarm's global batch is
``--peers x --batch-size``, so each epoch averages one batch per rank: the same samples the lone
process steps on. Each peer waits (up to a minute) until all ``--peers`` have joined before it
trains, prints its test accuracy, and with ``--json`` one JSON line at the end: the accuracy and
a fingerprint of the parameters after every epoch (with codec ``none`` all peers agree on all).
"""

import argparse
import hashlib
import json
import time

import numpy as np
import torch

import starling
import starling.datasets
import starling.torch


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def batch(train_x, train_y, k, rank, size):
    idx = np.random.default_rng([k, rank]).choice(len(train_y), size, replace=False)
    return torch.from_numpy(train_x[idx]), torch.from_numpy(train_y[idx])


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(torch.from_numpy(x)).argmax(-1) == torch.from_numpy(y)).float().mean().item()


def fingerprint(model):
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    return hashlib.sha256(flat.tobytes()).hexdigest()[:16]


def wait_for_peers(node, run_id, peers, timeout=60.0):
    """A barrier in the DHT: every peer writes its id under one key and reads until all are."""
    key = f"{run_id}.ready"
    deadline = time.monotonic() + timeout
    while True:
        try:
            node.store(key, node.peer_id, b"1", expiration=600)
        except starling.StarlingError:
            pass  # alone so far: nobody to acknowledge the record yet
        ready = len(node.get(key))
        if ready >= peers:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"only {ready} of {peers} peers joined within {timeout} s")
        time.sleep(0.2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--join", action="append", default=[])
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    ap.add_argument("--run-id", default="py-digits")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--codec", default="none")
    ap.add_argument("--compute-ms", type=float, default=0.0,
                    help="extra time per batch, as a larger model's compute would take")
    ap.add_argument("--alone", action="store_true", help="train one process on all ranks' samples")
    ap.add_argument("--wait-for", type=int, default=None,
                    help="peers to wait for before training (default: --peers)")
    ap.add_argument("--one-batch", action="store_true",
                    help="compute exactly one batch per epoch (wait for the swarm's step with "
                         "try_step): the global batch is then exactly the lone process's samples")
    ap.add_argument("--late", action="store_true",
                    help="join a run under way: sync its state, do not wait for the others")
    ap.add_argument("--json", action="store_true", help="print one JSON line at the end")
    args = ap.parse_args()

    train_x, train_y, test_x, test_y = starling.datasets.digits()
    model = mlp()
    prints = {}
    trouble = {}
    if args.alone:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        for k in range(args.epochs):
            parts = [batch(train_x, train_y, k, r, args.batch_size) for r in range(args.peers)]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    else:
        node = starling.Node(initial_peers=args.join, listen=[args.listen])
        print(json.dumps({"address": node.addresses[0]}) if args.json else f"join with --join {node.addresses[0]}",
              flush=True)
        opt = starling.torch.Optimizer(
            node=node,
            run_id=args.run_id,
            params=model.parameters(),
            optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr),
            batch_size_per_step=args.batch_size,
            target_batch_size=args.batch_size * args.peers,
            codec=args.codec,
            target_group_size=args.peers,
            # One batch per rank per epoch: only reported samples count towards the target.
            projected_batch=not args.one_batch,
        )
        joined = opt.epoch
        if not args.late:
            wait_for_peers(node, args.run_id, args.wait_for or args.peers)
        k = 0
        while opt.epoch < args.epochs:
            x, y = batch(train_x, train_y, k, args.rank, args.batch_size)
            k += 1
            time.sleep(args.compute_ms / 1000)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            report = opt.step()
            # (Until the swarm is seen past this peer's epoch: then it missed the round, and
            # its next step catches up.)
            while (args.one_batch and not report.stepped
                   and (report.swarm_epoch is None or report.swarm_epoch <= opt.epoch)):
                time.sleep(0.005)
                report = opt.try_step()
            opt.report_loss(loss.item())
            if report.stepped:
                prints[opt.epoch] = fingerprint(model)
                if report.errors or report.group_size != args.peers:
                    trouble[opt.epoch] = {"group": report.group_size, "errors": report.errors}
                if not args.json:
                    print(f"epoch {opt.epoch:3d}  loss {loss.item():.3f}  group {report.group_size}"
                          f"{'  errors: ' + '; '.join(report.errors) if report.errors else ''}", flush=True)
        # Serve the final state a little longer: a slower peer may still be in the last round.
        time.sleep(2)
        opt.shutdown()
        node.shutdown()
    acc = accuracy(model, test_x, test_y)
    if args.json:
        print(json.dumps({"accuracy": acc, "fingerprints": prints, "epochs": args.epochs,
                          "trouble": trouble, "joined": None if args.alone else joined}),
              flush=True)
    else:
        print(f"test accuracy {acc:.4f}")


if __name__ == "__main__":
    main()
