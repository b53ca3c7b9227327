"""Ctrl-C during a round: KeyboardInterrupt at once, and the process exits cleanly."""

import signal
import subprocess
import sys
import textwrap
import time

# Python leaves SIGINT ignored when it starts with it ignored, as it does under a parent that
# ignores it (bash runs `&` jobs that way when job control is off, and so a test command started
# in the background): the script installs Python's own handler, as a terminal session has it.
SCRIPT = textwrap.dedent(
    """
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy as np, starling
    node = starling.Node(listen=["/ip4/127.0.0.1/tcp/0"])
    averager = starling.Averager(node, "py-interrupt", matchmaking_time=60)
    print("stepping", flush=True)
    averager.step([np.ones(1000, np.float32)], timeout=120)
    """
)


def test_ctrl_c_during_a_round_raises_keyboard_interrupt_and_the_process_exits():
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "stepping"
        time.sleep(1.0)  # inside the step's matchmaking window (60 s)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
        assert time.monotonic() - sent < 10, "the interrupt took too long"
        assert "KeyboardInterrupt" in err, err
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
