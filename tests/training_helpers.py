"""Model, loss and data shared by the training tests (small, real: scikit-learn's digits)."""

import faulthandler
import math
import os
import signal
import subprocess
import textwrap
import threading
import time

import keras
import psutil

import workbench as wb


def make_model():
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

# Where a fresh model's loss starts: the cross-entropy of uniform predictions over the 10 digits (a Glorot-initialised
# model's are near uniform). Tests hold a job's last steps below a fraction of it, not below its first step's loss:
# in async-ps, step 0 may run after the other worker's first call already updated the model (seen: 0.32).
UNTRAINED_LOSS = math.log(10)


def late_loss(history: list[dict], steps: int = 10) -> float:
    """The mean loss of a job's last ``steps`` steps (one async-ps step's loss swings with what it read)."""
    return sum(r["loss"] for r in history[-steps:]) / len(history[-steps:])

# Steps after which ``train``'s model is held to 90 % on the held-out digits. Async-ps interleaves the
# workers' updates differently each run, so the accuracy its last step leaves spreads: at 300 steps,
# 20 runs on a loaded 2-core machine gave 0.907 twice (and CI once 0.889); at 450 the lowest was 0.944, and
# 0.929 on another day, but once 0.86 inside the whole suite (test_training holds async-ps to 0.80).
STEPS_TO_LEARN = 450


def train(cluster, model=make_model, **kwargs):
    options = dict(loss=LOSS, optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"], steps=STEPS_TO_LEARN,
                   batch_size=64, seed=7)
    options.update(kwargs)
    return wb.train(cluster, model, wb.datasets.digits, **options)


# A job that only has to be training while a test looks at something else (a browser page, the panel, a second
# kernel) is paced: each example waits PACE_MICROSECONDS in its worker's input pipeline, as tutorial 03's straggler's
# do, so that its tasks mostly sleep (a worker's 32 examples a step: about 30 steps a second). Unpaced, such a
# 100,000-step job trained as fast as the machine let it for the whole of a browser test, and took the cores from
# everything else the suite ran beside it. ``PACED_DIGITS`` defines ``paced_digits`` where ``wb`` is imported.
PACE_MICROSECONDS = 1000
PACED_DIGITS = f"""
def paced_digits(ctx):
    from tensorflow.python.data.experimental.ops import testing

    return wb.datasets.digits(ctx).apply(testing.sleep({PACE_MICROSECONDS}))
"""


# Steps a launcher's test trains: enough for the loss to fall well below where it starts, few enough to be quick.
STEPS_OF_A_MECHANIC = 150


def assert_trained(job, steps: int, workers: set[str]) -> None:
    """The mechanics of a finished job, whatever the run's interleaving: every step ran once, on ``workers``,
    the loss fell to under half of where it began, and the trained variables evaluate on the held-out digits."""
    assert job.state == "finished", job.error
    history = job.history
    assert [r["step"] for r in history] == list(range(steps))
    assert {w for r in history for w in r["worker"].split(",")} == workers
    # where it began: the first steps to start, run from the initial weights; where it ended: the last to end. Not
    # by step number: in async-ps a worker whose first call was slow to set up (SSH engines under load) ran steps
    # 0-2 after another worker had trained (0.16 read for about 2.3), and another worker's first call, steps 10-19,
    # may start from weights that learned (averaging those once read 0.64)
    began, ended = sorted(history, key=lambda r: r["start"])[:3], sorted(history, key=lambda r: r["end"])[-10:]
    first, last = (sum(r["loss"] for r in part) / len(part) for part in (began, ended))
    assert last < first / 2, (first, last)
    assert job.evaluate(wb.datasets.digits_test)["examples"] == 450


def signal_process(pid: int, sig: int) -> None:
    """Send ``sig`` to a process the test started (an engine, a controller), never to the test itself.

    A pid of 0, 1, this process or one of its parents, or one in this process's group would stop or
    kill the test run (and ``make`` with it) instead of the task: refused with what was asked.
    """
    me = psutil.Process()
    ours = {me.pid, *(p.pid for p in me.parents())}
    assert pid > 1 and pid not in ours and os.getpgid(pid) != os.getpgid(0), (
        f"refusing to send signal {sig} to pid {pid}: it is not a process the test started")
    os.kill(pid, sig)
    if sig == signal.SIGSTOP:  # kill() returns before the process stops: its threads run on until they enter the
        _wait_until_stopped(pid)  # kernel (a step of a loaded machine's worker finished after, and counted as its)


def _wait_until_stopped(pid: int, seconds: float = 5.0) -> None:
    """Wait until every thread of ``pid`` is stopped (state T in /proc), at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as stat:
                    states.append(stat.read().rpartition(")")[2].split()[0])
            except OSError:  # a thread that ended meanwhile
                continue
        if states and all(state in "Tt" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not stop within {seconds} s of SIGSTOP")


def wait_for(condition, seconds: float, what) -> None:
    """Poll ``condition()`` until it is true; fail naming ``what`` after ``seconds`` (a callable: its answer then, to
    say what was last seen)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {seconds} s waiting for {what() if callable(what) else what}"
        time.sleep(0.05)


class Watchdog:
    """How long this process went without running Python: a thread that ticks every 50 ms records its longest gap.

    A thread holding the GIL (TensorFlow registering a function while it waits on the network) or a
    frozen process shows as a long gap; ``with Watchdog() as dog: ...`` then ``dog.longest``.

    With ``stacks`` (an open file), each tick re-arms ``faulthandler.dump_traceback_later(dump_after)``, whose own
    thread needs no GIL: ticks stopped that long write every thread's stack at that moment (``bench/stalls.py``).
    faulthandler has one such timer per process: not in a test, where ``stuck_tests`` arms it.
    """

    TICK = 0.05

    def __init__(self, stacks=None, dump_after: float = 0.3):
        self.longest, self.stacks, self.dump_after = 0.0, stacks, dump_after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="test-watchdog", daemon=True)

    def _tick(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.TICK):
            if self.stacks is not None:
                faulthandler.dump_traceback_later(self.dump_after, file=self.stacks)
            now = time.monotonic()
            self.longest = max(self.longest, now - last - self.TICK)
            last = now
        if self.stacks is not None:
            faulthandler.cancel_dump_traceback_later()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def poll_responsive(condition, seconds: float, what: str) -> float:
    """``wait_for`` in the main thread, also returning its longest stall: how late a 50 ms sleep came back."""
    deadline, longest = time.monotonic() + seconds, 0.0
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {seconds} s waiting for {what}"
        before = time.monotonic()
        time.sleep(0.05)
        longest = max(longest, time.monotonic() - before - 0.05)
    return longest


def attached_trainer(cluster_name: str) -> str:
    """A script that attaches to ``cluster_name``, trains in the background, prints ``"<job> (pid N)"`` (the name
    the owner shows it under), and stops when its stdin closes: a second kernel training on the cluster."""
    return "import os, sys, keras, workbench as wb\n" + PACED_DIGITS + textwrap.dedent(f"""
        cluster = wb.attach({cluster_name!r})
        job = wb.train(cluster, lambda: keras.Sequential([keras.Input((64,)), keras.layers.Dense(16), keras.layers.Dense(10)]),
                       paced_digits, keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps=100000)
        print(f"{{job.name}} (pid {{os.getpid()}})", flush=True)
        sys.stdin.read()
        job.stop()
        cluster.stop()
    """)


def close_and_wait(process, timeout: float) -> None:
    """Close a child's stdin (its signal to stop) and wait for it; kill it if it is still there after ``timeout`` s."""
    process.stdin.close()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
