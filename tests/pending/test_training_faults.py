"""PENDING (not collected): backup workers do not yet shield a stalled worker; see README here."""

import os
import signal
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

import workbench as wb
from training_helpers import train

pytestmark = pytest.mark.cluster


@contextmanager
def straggler(pid: int, stopped: float = 0.08, running: float = 0.02):
    """Make a process about 5x slower: SIGSTOP/SIGCONT duty cycling, as a busy or failing host would."""
    done = threading.Event()

    def cycle():
        for _ in range(100_000):  # bounded; ends long before this on `done`
            if done.is_set():
                break
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped)
            os.kill(pid, signal.SIGCONT)
            if done.wait(running):
                break

    thread = threading.Thread(target=cycle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10)
        os.kill(pid, signal.SIGCONT)


def _slow_share(job, worker):
    return np.mean([worker in r["worker"].split(",") for r in job.history])


def test_backup_worker_keeps_steps_from_waiting_for_a_straggler(cluster3):
    slow = cluster3.task("worker:2")
    train(cluster3, strategy="sync-ps", steps=3, batch_size=60).wait(120)  # connected and traced before it slows
    with straggler(slow.pid):
        started = time.monotonic()
        waiting = train(cluster3, strategy="sync-ps", backup_workers=0, steps=40, batch_size=60).wait(600)
        waiting_seconds = time.monotonic() - started
        started = time.monotonic()
        backup = train(cluster3, strategy="sync-ps", backup_workers=1, steps=300, batch_size=60).wait(600)
        backup_seconds_per_step = (time.monotonic() - started) / 300
    # k=0: every step waited for the straggler's gradient
    assert all(r["aggregated"] == 3 for r in waiting.history)
    assert _slow_share(waiting, "worker:2") == 1.0
    assert waiting.dropped_gradients == 0
    # k=1: steps closed on the two fast gradients; the straggler's came late and were dropped
    assert _slow_share(backup, "worker:2") < 0.5
    assert backup.dropped_gradients > 0
    assert backup_seconds_per_step < waiting_seconds / 40
    # and the model still converges
    assert backup.evaluate(wb.datasets.digits_test)["accuracy"] >= 0.90


