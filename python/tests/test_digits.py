"""The PyTorch MLP on the embedded digits (examples/python/digits.py) in 4 processes with
starling.torch.Optimizer: test accuracy near one process trained alone on the same samples, and with codec none every process holds bit-identical parameters after every epoch."""

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python", "digits.py")
EPOCHS = "50"  # where the accuracy has levelled off (0.97 alone), so runs compare


def run(*args):
    return subprocess.Popen(
        # 20 ms per batch, as a real model's compute takes: with none at all (this MLP takes
        # well under a millisecond) a peer can fill the first global batches alone before the
        # others' progress reaches it, and those rounds form partial groups.
        [sys.executable, EXAMPLE, "--json", "--epochs", EPOCHS, "--run-id", "py-digits-test",
         "--compute-ms", "20", *args],
        stdout=subprocess.PIPE,
        text=True,
    )


@contextlib.contextmanager
def processes():
    """A list to start example processes into; those still running at the end are killed."""
    procs = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def results_of(procs):
    """Every process's final JSON line, once each has exited cleanly."""
    results = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        assert p.wait(timeout=60) == 0
    return results


def test_four_processes_match_one_alone_and_hold_the_same_bits_every_epoch():
    with processes() as procs:
        # One batch per rank per epoch (try_step waits for the swarm's step), so the global
        # batches are exactly the lone process's.
        first = run("--rank", "0", "--one-batch")
        procs.append(first)
        address = json.loads(first.stdout.readline())["address"]
        procs += [run("--rank", str(r), "--join", address, "--one-batch") for r in (1, 2, 3)]
        for p in procs[1:]:
            json.loads(p.stdout.readline())  # started
        results = results_of(procs)
    alone = subprocess.run(
        [sys.executable, EXAMPLE, "--json", "--epochs", EPOCHS, "--alone"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    alone_acc = json.loads(alone.stdout.strip().splitlines()[-1])["accuracy"]
    accs = [r["accuracy"] for r in results]
    print("swarm accuracies", accs, "alone", alone_acc)
    assert all(abs(a - alone_acc) <= 0.01 for a in accs), (accs, alone_acc)
    # Every epoch that every process saw end, up to the first epoch whose round did not
    # average all four on some process (a timeout under load: that process keeps its own
    # values for a span, and state averaging brings the peers together again later): the same
    # parameters everywhere. Such troubled epochs are printed; most epochs must be clean.
    prints = [r["fingerprints"] for r in results]
    troubled = sorted({int(e) for r in results for e in r["trouble"]})
    common = sorted(set.intersection(*(set(map(int, p)) for p in prints)))
    clean = [e for e in common if not troubled or e < troubled[0]]
    print("epochs checked", len(clean), "of", len(common), "troubled", troubled)
    assert len(clean) >= int(EPOCHS) // 2, json.dumps([r["trouble"] for r in results])
    for epoch in clean:
        assert len({p[str(epoch)] for p in prints}) == 1, f"processes differ after epoch {epoch}"


def test_a_late_process_syncs_the_state_and_steps_in_the_others_epoch():
    """Three processes start a run; a fourth starts while they train, downloads the run's
    state and steps in the run's next epochs, training with the others (not alone).

    From its first step on it holds the others' bits after every epoch: a donor serves the state
    of the epoch it finished while it may already be in the next round, but rounds are tagged
    with their epoch, so a joiner whose state is an epoch old does not average with the others
    (which would leave it apart until the next state round); its round says it is behind, and it
    syncs again. Processes differ only after a round that did not hold all four (a partial
    group, which happens now and then under load), and only until the next state round."""
    epochs = "150"
    with processes() as procs:
        first = run("--rank", "0", "--wait-for", "3", "--run-id", "py-digits-late", "--epochs", epochs)
        procs.append(first)
        address = json.loads(first.stdout.readline())["address"]
        procs += [run("--rank", str(r), "--join", address, "--wait-for", "3",
                      "--run-id", "py-digits-late", "--epochs", epochs) for r in (1, 2)]
        for p in procs[1:]:
            json.loads(p.stdout.readline())  # started
        time.sleep(1.5)  # the three are training by now
        late = run("--rank", "3", "--join", address, "--late", "--run-id", "py-digits-late",
                   "--epochs", epochs)
        procs.append(late)
        json.loads(late.stdout.readline())
        results = results_of(procs)
    joined = results[3]["joined"]
    prints = [{int(e): f for e, f in r["fingerprints"].items()} for r in results]
    first_step = min(prints[3])
    same = {e: len({p.get(e) for p in prints}) == 1 for e in sorted(prints[3])}
    differ = [e for e, ok in same.items() if not ok]
    print("late joiner synced at epoch", joined, "first stepped epoch", first_step,
          "epochs where it differs", differ, "its trouble", results[3]["trouble"],
          "others' after it joined", [{e: t for e, t in r["trouble"].items() if int(e) > joined}
                                      for r in results[:3]])
    assert 0 < joined < int(epochs) - 10, "it joined a run under way"
    # It steps as soon as it has caught up, a few epochs after the state it downloaded: a
    # joiner that finds the swarm ahead syncs again before its first step, and each sync takes
    # about two of these short epochs (2 to 9 epochs in 20 local runs, 4 processes on 2 cores).
    assert joined < first_step < joined + 16, "it steps in the run's next epochs"
    # From then on it is in the others' groups: every round has all four members but for a few
    # epochs around its first step. A member that misses a round while the group grows (busy
    # serving the joiner its state, say) is behind and syncs, which takes about two of these
    # short epochs, and another may miss the next rounds in turn: CI saw partial rounds at
    # 34, 35 and 36 after a first step at 33 (one process out of 33-34, the joiner of 35-36).
    after = sorted({int(e) for r in results for e in r["trouble"] if int(e) > first_step})
    assert len(after) <= 4, [r["trouble"] for r in results]
    troubled = sorted({int(e) for r in results for e in r["trouble"]})
    for e in differ:
        assert any(t <= e < t + 11 for t in troubled), f"epoch {e} differs after no partial round"

