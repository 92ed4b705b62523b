"""TensorFlow profiler traces (``*.xplane.pb``) -> ``OpEvent`` records, Send->consumer links, Chrome traces.

Pure: reads files or bytes, no cluster. What a capture holds (TF 2.21, checked on real captures):
one ``/host:CPU`` plane per task (GPU planes too on GPU hosts), one line per thread, events named
``node/name:OpType``; a ``Task Environment`` plane with ``profile_start_time`` (ns since the epoch).
Event time = start + line timestamp (ns) + offset (ps). ``_Send`` events carry ``key`` (the
rendezvous key ``src;incarnation;dst;edge;frame``), ``from`` and ``to`` (the node consuming the
value on the destination device). The matching ``_Recv`` is not traced on CPU, so a transfer is
linked to the first run of its consumer on the destination task after the send started.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

from ..compat import tensorflow as tf_compat
from .events import OpEvent

# Threads whose events are the profiler's and the thread pools' own bookkeeping, and the eager
# runtime's spans around remote requests and op dispatch: they wrap ops that are traced on their own.
_NOISE_PREFIXES = ("ThreadpoolListener", "ExecutorState", "Iterator::", "EagerKernelExecute", "EagerLocalExecute",
                   "EagerService")
LINK_WINDOW_S = 1.0  # a consumer that runs later than this after the send is not its receiver


def _stat_values(plane, stats) -> dict:
    values = {}
    for stat in stats:
        kind = stat.WhichOneof("value")
        if kind is None:
            continue
        value = getattr(stat, kind)
        if kind == "ref_value":
            value = plane.stat_metadata[value].name
        elif kind == "bytes_value":
            continue
        values[plane.stat_metadata[stat.metadata_id].name] = value
    return values


def _device_of_plane(plane_name: str, device_prefix: str) -> str | None:
    if plane_name.startswith("/host:"):
        return f"{device_prefix}/device:CPU:0"
    if plane_name.startswith("/device:GPU:"):
        return f"{device_prefix}/device:GPU:{plane_name.split(':')[-1].split(' ')[0]}"
    return None


def _thread_names(lines) -> dict[int, str]:
    """``tf_Compute/-2524305337588316300`` -> ``tf_Compute #1`` (numbered within each pool)."""
    counts: dict[str, int] = defaultdict(int)
    names = {}
    for line in sorted(lines, key=lambda each: each.name):
        pool = (line.display_name or line.name).split("/")[0]
        counts[pool] += 1
        names[line.id] = f"{pool} #{counts[pool]}"
    return names


def parse_xspace(source: str | Path | bytes, task: str, device_prefix: str, clock_offset: float = 0.0) -> list[OpEvent]:
    """The op events of one task's capture, on the kernel's clock (``clock_offset``: the task's clock ahead)."""
    space = tf_compat.xspace()
    space.ParseFromString(source if isinstance(source, bytes) else Path(source).read_bytes())
    start_ns = 0
    for plane in space.planes:
        if plane.name == "Task Environment":
            start_ns = int(_stat_values(plane, plane.stats).get("profile_start_time", 0))
    events: list[OpEvent] = []
    for plane in space.planes:
        device = _device_of_plane(plane.name, device_prefix)
        if device is None:
            continue
        kept = {}  # metadata id -> (name, op type), for TF ops only
        for mid, meta in plane.event_metadata.items():
            full = meta.name
            if ":" not in full or "::" in full or full.startswith(_NOISE_PREFIXES):
                continue
            name, _, op_type = full.rpartition(":")
            kept[mid] = (name.strip(), op_type.strip() or meta.display_name)
        threads = _thread_names(plane.lines)
        row_prefix = device.replace("/replica:0", "")
        for line in plane.lines:
            base_ns = line.timestamp_ns + (start_ns if line.timestamp_ns < 10**17 else 0)  # relative in TF 2.21
            row = f"{row_prefix} · {threads[line.id]}"
            for event in line.events:
                if event.metadata_id not in kept:
                    continue
                name, op_type = kept[event.metadata_id]
                start = (base_ns + event.offset_ps / 1000.0) / 1e9 - clock_offset
                end = start + event.duration_ps / 1e12
                transfer = {}
                if op_type in ("_Send", "_Recv", "_HostSend", "_HostRecv"):
                    stats = _stat_values(plane, event.stats)
                    key = str(stats.get("key", ""))
                    parts = key.split(";")
                    if len(parts) >= 3:
                        transfer = dict(transfer_key=key, source_device=parts[0], target_device=parts[2])
                    if "to" in stats:
                        transfer["args"] = {"to": str(stats["to"]), "from": str(stats.get("from", ""))}
                events.append(OpEvent(task, device, row, name, op_type, start, end, **transfer))
    events.sort(key=lambda e: e.start)
    return events


def link_transfers(events: Iterable[OpEvent]) -> list[tuple[OpEvent, OpEvent]]:
    """Pair each traced transfer with its receiving side on another device.

    The receiver is a ``_Recv`` with the same rendezvous key when one was traced (GPU captures have
    them), otherwise a run of the send's consumer node (``to``) on the destination device: the
    first one that starts after the send, within ``LINK_WINDOW_S``, and before the next send of the
    same edge (a run after that belongs to the later send; when the trace lacks a run, its send stays
    unlinked instead of shifting every later pair). One run may receive several edges, as a fused
    op reads a kernel and a bias.
    """
    events = list(events)
    receivers: dict[tuple[str, str], list[OpEvent]] = defaultdict(list)
    for event in events:
        if event.is_transfer and "Recv" in event.op_type:
            receivers[("recv", event.transfer_key)].append(event)
        receivers[(event.device, event.name)].append(event)
    edges: dict[tuple[str, str, str], list[OpEvent]] = defaultdict(list)
    for send in _sends_between_devices(events):
        edges[(send.device, send.name, send.target_device)].append(send)
    for group in (*receivers.values(), *edges.values()):
        group.sort(key=lambda e: e.start)
    starts = {key: [e.start for e in group] for key, group in receivers.items()}

    def first_after(key: tuple[str, str], t: float) -> OpEvent | None:
        times = starts.get(key, [])
        i = bisect.bisect_left(times, t)
        return receivers[key][i] if i < len(times) else None

    pairs = []
    for sends in edges.values():
        for send, following in zip(sends, [*sends[1:], None]):
            before = following.start if following is not None else float("inf")
            consumer = (send.target_device, send.args.get("to", ""))
            for receiver in (first_after(("recv", send.transfer_key), send.start), first_after(consumer, send.start)):
                if receiver is not None and receiver.start < before and receiver.start - send.start <= LINK_WINDOW_S:
                    pairs.append((send, receiver))
                    break
    pairs.sort(key=lambda pair: pair[0].start)
    return pairs


def _sends_between_devices(events: Iterable[OpEvent]) -> Iterable[OpEvent]:
    return (e for e in events if e.is_transfer and "Send" in e.op_type and e.target_device != e.device)


UNLINKED_TO_CLIENT = "to the client (this kernel is not traced)"
UNLINKED_NOT_TRACED = "consumer never traced (a control edge, or an op the profiler does not record)"
UNLINKED_OUTSIDE = "no run of the consumer between this send and the next of its edge"


def explain_unlinked(events: Iterable[OpEvent], transfers: Iterable[tuple[OpEvent, OpEvent]]) -> dict[str, int]:
    """Why each Send between devices that ``link_transfers`` left unpaired has no receiver in the trace.

    ``UNLINKED_TO_CLIENT``: results sent to the client (``/job:localhost``), whose process is not
    profiled. ``UNLINKED_NOT_TRACED``: the consumer node never appears on the destination device;
    control edges end in ``NoOp``/``Identity`` nodes that TensorFlow runs without a traced kernel.
    ``UNLINKED_OUTSIDE``: the consumer ran, but not after this send and before the next send of its
    edge (within ``LINK_WINDOW_S``): the capture ended before the receiver ran, or the profiler
    dropped that run.
    """
    events = list(events)
    linked = {id(send) for send, _ in transfers}
    traced_nodes = {(e.device, e.name) for e in events}
    reasons: Counter[str] = Counter()
    for send in _sends_between_devices(events):
        if id(send) in linked:
            continue
        if "/job:localhost/" in send.target_device:
            reasons[UNLINKED_TO_CLIENT] += 1
        elif (send.target_device, send.args.get("to", "")) not in traced_nodes:
            reasons[UNLINKED_NOT_TRACED] += 1
        else:
            reasons[UNLINKED_OUTSIDE] += 1
    return dict(reasons.most_common())


_JOB_ORDER = {"chief": 0, "ps": 1, "worker": 2}  # processes listed as the cluster lists its tasks


def task_order(task: str) -> tuple:
    """Sort key of a task name (``"ps:0"``, ``"worker:10"``): chief, ps, workers, each by index."""
    job, _, index = task.partition(":")
    return _JOB_ORDER.get(job, len(_JOB_ORDER)), job, int(index) if index.isdigit() else 0


def _process_order(event: OpEvent) -> tuple:
    return (*task_order(event.task), event.device)


def chrome_trace(events: Iterable[OpEvent], transfers: Iterable[tuple[OpEvent, OpEvent]] | None = None) -> dict:
    """The Chrome trace event format (Perfetto, chrome://tracing): a process per device, a thread per row.

    ``transfers`` become flow arrows from each send to its receiver; None links them here
    (``link_transfers``). Times are microseconds from the first event; ``otherData.start_unix_s``
    says when that was.
    """
    events = list(events)
    transfers = link_transfers(events) if transfers is None else list(transfers)
    origin = min((e.start for e in events), default=0.0)
    pids: dict[str, int] = {}
    tids: dict[str, int] = {}
    trace: list[dict] = []
    for event in sorted(events, key=lambda e: (_process_order(e), e.row)):
        if event.device not in pids:
            pids[event.device] = pid = len(pids) + 1
            trace.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                          "args": {"name": f"{event.task} {event.device}"}})
            trace.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        if event.row not in tids:
            tids[event.row] = tid = len(tids) + 1
            pid = pids[event.device]
            trace.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                          "args": {"name": event.row.split(" · ")[-1]}})
            trace.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})

    def at(event: OpEvent) -> dict:
        return {"pid": pids[event.device], "tid": tids[event.row], "ts": round((event.start - origin) * 1e6, 3)}

    for event in events:
        trace.append({"ph": "X", "name": event.name, "cat": event.op_type, **at(event),
                      "dur": round(max(event.duration, 0.0) * 1e6, 3), "args": {"op": event.op_type, "task": event.task}})
    # A flow's ends bind to the slices that enclose them: the send itself, and the receiver ("bp": "e").
    for n, (send, receiver) in enumerate(transfers, start=1):
        trace.append({"ph": "s", "id": n, "name": "transfer", "cat": "transfer", **at(send)})
        trace.append({"ph": "f", "bp": "e", "id": n, "name": "transfer", "cat": "transfer", **at(receiver)})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"start_unix_s": origin}}


def save_chrome_trace(events: Iterable[OpEvent], path: str | Path,
                      transfers: Iterable[tuple[OpEvent, OpEvent]] | None = None) -> Path:
    """Write ``chrome_trace(events, transfers)`` as JSON to ``path`` (folders created); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events, transfers)))
    return path
