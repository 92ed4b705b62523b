"""``cluster.profile(seconds)``: one op-level trace of every task at once, parsed into a ``Profile``.

Each engine runs TensorFlow's profiler service (started on first use, on a port the engine
reserves). The kernel asks all of them to trace the same window with one
``tf.profiler.experimental.client.trace`` call; each task writes ``<host>_<port>.xplane.pb``,
which names the task it came from.
"""

from __future__ import annotations

import math
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

from .. import native_logs
from ..errors import ConfigurationError, WorkbenchError
from .events import OpEvent
from .trace import explain_unlinked, link_transfers, parse_xspace, save_chrome_trace

MAX_SECONDS = 60.0
SERVER_START_TIMEOUT = 60.0
TRACE_SLACK = 60.0  # beyond the traced seconds: connecting, collecting and writing each task's trace


class ProfileError(WorkbenchError):
    """A profile could not be captured or read; the message says which task and what to do."""


class ProfileTimeout(ProfileError):
    """A profiler service did not start, or the capture did not finish, within the time allowed."""


class Profile:
    """An op-level trace of a cluster's tasks: ``events`` (``OpEvent``), ``transfers`` (Send -> receiver).

    Display it in a notebook for the timeline (one row per device and thread of each task, ops as
    bars, transfers as links); ``save_chrome_trace(path)`` for Perfetto or chrome://tracing.
    """

    def __init__(self, events: list[OpEvent], tasks: list[str], logdir: str, seconds: float, started: float):
        self.events = sorted(events, key=lambda e: e.start)
        self.transfers = link_transfers(self.events)
        self.tasks = list(tasks)
        self.logdir = logdir
        self.seconds = seconds
        self.started = started
        order = {task: i for i, task in enumerate(self.tasks)}  # ps first, then workers, as cluster.tasks
        task_of: dict[str, str] = {}
        for event in self.events:
            task_of.setdefault(event.row, event.task)
        self.rows = sorted(task_of, key=lambda row: (order.get(task_of[row], len(order)), row))

    def save_chrome_trace(self, path: str | Path) -> Path:
        """Write the trace as Chrome trace JSON (with flow arrows for the transfers); return the path."""
        return save_chrome_trace(self.events, path, self.transfers)

    def unlinked(self) -> dict[str, int]:
        """How many Sends between devices have no receiver in the trace, by reason (``explain_unlinked``)."""
        return explain_unlinked(self.events, self.transfers)

    def summary(self) -> dict:
        """Events per task, transfers per pair of tasks, Sends left unlinked (by reason), and the ops with the most total time."""
        per_op: dict[str, float] = defaultdict(float)
        for event in self.events:
            per_op[event.op_type] += event.duration
        return {
            "events": dict(Counter(e.task for e in self.events)),
            "transfers": {f"{a} -> {b}": n for (a, b), n in Counter((s.task, r.task) for s, r in self.transfers).items()},
            "unlinked_sends": self.unlinked(),
            "top_ops_ms": {op: round(t * 1000, 3) for op, t in sorted(per_op.items(), key=lambda kv: -kv[1])[:10]},
            "seconds": self.seconds,
        }

    def plot(self):
        """The Bokeh layout of the trace (the dashboards' timeline figure)."""
        from ..dashboard.profile_view import profile_plot

        title = f"Profile: {self.seconds:g} s of {', '.join(self.tasks)} ({len(self.events):,} ops, {len(self.transfers):,} transfers)"
        return profile_plot(self.rows, self.events, self.transfers, title)

    def _ipython_display_(self) -> None:
        plot = self.plot()  # first: it imports Bokeh the one-thread-at-a-time way (compat.bokeh.load)
        from bokeh.io import output_notebook, show
        from bokeh.resources import INLINE

        output_notebook(resources=INLINE, hide_banner=True)
        show(plot)

    def __repr__(self) -> str:
        return (f"<workbench.Profile {self.seconds:g} s: {len(self.events):,} ops on {', '.join(self.tasks)}, "
                f"{len(self.transfers):,} transfers linked; logdir {self.logdir}>")


def _check_seconds(seconds) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or math.isnan(seconds) \
            or not 0 < seconds <= MAX_SECONDS:
        raise ConfigurationError(f"seconds={seconds!r}: capture between 0 and {MAX_SECONDS:g} seconds, e.g. cluster.profile(seconds=2).")
    return float(seconds)


def _start_servers(cluster, timeout: float) -> dict[str, int]:
    """The profiler port of each task's engine.

    Asked of the engines on every capture (an engine starts its service once and then answers
    with the same port), so a task restarted on a new engine is traced on its new port.
    """
    from ..cluster.launch import engine_side
    from ..cluster.launch.calls import Deadline, RemoteCallFailed, RemoteCallsTimedOut, run_on_engines

    records = cluster.tasks
    try:
        ports = run_on_engines(cluster.client, {r.engine_id: (engine_side.start_profiler_server,) for r in records},
                               Deadline(timeout))
    except RemoteCallFailed as exc:
        task = next((r.name for r in records if r.engine_id == exc.engine), f"engine {exc.engine}")
        raise ProfileError(f"the profiler service did not start on {task}: {exc.reason}. Check cluster.status().") from None
    except RemoteCallsTimedOut as exc:
        tasks = ", ".join(r.name for r in records if r.engine_id in exc.pending)
        raise ProfileTimeout(f"{tasks} did not start the profiler service within {timeout:.0f} s "
                           "(busy or stalled engine): check cluster.status() and try again.") from None
    return {r.name: ports[r.engine_id] for r in records}


def _find_traces(logdir: str, records, ports: dict[str, int], since: float) -> dict[str, Path]:
    """Each task's ``<host>_<profiler port>.xplane.pb`` written by this capture (newer than ``since``).

    Older runs in a reused ``logdir`` are ignored, so a task that wrote nothing this time is
    reported, not silently drawn from an earlier capture.
    """
    files = [f for f in Path(logdir).glob("plugins/profile/*/*.xplane.pb") if f.stat().st_mtime >= since]
    if not files:
        raise ProfileError(f"the capture wrote no trace files into {logdir}: the tasks may be busy or unreachable. "
                           "Try again, or check cluster.status().")
    found = {}
    for record in records:
        port = ports[record.name]
        mine = sorted((f for f in files if f.name.endswith(f"_{port}.xplane.pb")), key=lambda f: f.stat().st_mtime)
        if not mine:
            raise ProfileError(f"the profiler on {record.name} (engine {record.engine_id}, port {port}) wrote no trace "
                               f"into {logdir}: the task may be busy or unreachable. Try again, or check cluster.status().")
        found[record.name] = mine[-1]
    return found


def capture(cluster, seconds: float = 2.0, logdir: str | None = None, timeout: float | None = None) -> Profile:
    """Trace every task of ``cluster`` for ``seconds``; see ``Cluster.profile``.

    ``timeout`` bounds the whole call (default: ``seconds`` + 60 s); ``ProfileTimeout`` past it.
    """
    import tensorflow as tf

    seconds = _check_seconds(seconds)
    timeout = seconds + TRACE_SLACK if timeout is None else float(timeout)
    if not timeout > seconds:
        raise ConfigurationError(f"timeout={timeout!r} must exceed seconds={seconds:g}: the trace alone takes that long.")
    if cluster.state != "running":
        raise ProfileError(f"cannot profile cluster {cluster.name!r}: it is {cluster.state}. Start it first.")
    called = time.monotonic()
    ports = _start_servers(cluster, min(SERVER_START_TIMEOUT, timeout - seconds))
    records = cluster.tasks
    addresses = {r.name: f"{r.address.rpartition(':')[0]}:{ports[r.name]}" for r in records}
    # by default in the cluster's own temporary directory, removed with the cluster (pass logdir= to keep the traces)
    logdir = logdir or tempfile.mkdtemp(prefix=f"workbench-profile-{cluster.name}-", dir=cluster.scratch or None)
    offsets = cluster.clock_offsets()
    failure: list[BaseException] = []

    def trace() -> None:
        try:
            options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0,
                                                               device_tracer_level=1)
            tf.profiler.experimental.client.trace(",".join(f"grpc://{a}" for a in addresses.values()), logdir,
                                                  int(seconds * 1000), num_tracing_attempts=1, options=options)
        except Exception as exc:  # noqa: BLE001 - reported below, naming the tasks
            failure.append(exc)

    started = time.time()
    # The gRPC call cannot be cancelled from here: it runs in a daemon thread we stop waiting for.
    thread = threading.Thread(target=trace, daemon=True, name="workbench-profile")
    with native_logs.stdout_to_log():  # the profiler client prints "Starting to trace for ..." from C++
        thread.start()
        thread.join(max(timeout - (time.monotonic() - called), 0.0))
    if thread.is_alive():
        raise ProfileTimeout(f"the profile of {', '.join(addresses)} did not finish within {timeout:.0f} s: a task is "
                             "stalled or unreachable. Check cluster.status(), or pass a longer timeout.")
    if failure and "no trace event" in str(failure[0]).lower():
        raise ProfileError(f"nothing ran on the tasks of cluster {cluster.name!r} during the {seconds:g} s capture, so "
                           "there is no op to show: profile while a job trains (job = wb.train(...); "
                           "cluster.profile(seconds=2)), or while a %%wb on cell runs.") from None
    if failure:
        raise ProfileError(f"the profiler could not trace {', '.join(addresses)}: {failure[0]}") from None
    traces = _find_traces(logdir, records, ports, since=started - 1.0)  # 1 s: coarse file-system clocks
    events: list[OpEvent] = []
    for record in records:
        events.extend(parse_xspace(traces[record.name], record.name, record.task.device, offsets.get(record.name, 0.0)))
    _trim_after_trace(cluster, records)
    return Profile(events, [r.name for r in records], logdir, seconds, started)


def _trim_after_trace(cluster, records) -> None:
    """The traced engines and this kernel freed their trace buffers: return that memory to the system.

    Sent without waiting for the answers (an engine busy with a job answers when it can).
    """
    from ..cluster.machine.memory import trim_memory

    cluster.client[[r.engine_id for r in records]].apply_async(trim_memory)
    trim_memory()
