"""A job's step timeline as a Chrome trace (Perfetto, chrome://tracing): the spans the dashboards draw.

Each task is a process, each of its devices a thread; each step phase (``compute``, ``push+apply``,
``apply``, ``allreduce+apply``) a complete event with its steps and examples; each fault or health
change of the job (``TaskEvent``) an instant event on its task. Times are microseconds from the first
span, on the kernel's clock (spans are already shifted by each host's measured offset).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .events import StepSpan, TaskEvent
from .trace import task_order


def step_trace(spans: Iterable[StepSpan], events: Iterable[TaskEvent] = (), title: str = "") -> dict:
    """The trace of finished ``spans`` and ``events`` in the Chrome trace event format."""
    spans = sorted((s for s in spans if s.end is not None), key=lambda s: s.start)
    events = list(events)
    origin = min([s.start for s in spans] + [e.time for e in events], default=0.0)
    tasks = sorted({s.task for s in spans} | {e.task for e in events}, key=task_order)
    pids = {task: n for n, task in enumerate(tasks, start=1)}
    tids: dict[tuple[str, str], int] = {}
    trace: list[dict] = []
    for task, pid in pids.items():
        trace.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": task}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for span in spans:
        key = (span.task, span.device)
        if key not in tids:
            tids[key] = tid = sum(1 for t, _ in tids if t == span.task) + 1
            trace.append({"ph": "M", "name": "thread_name", "pid": pids[span.task], "tid": tid,
                          "args": {"name": span.device}})
        trace.append({"ph": "X", "name": span.phase, "cat": "step", "pid": pids[span.task], "tid": tids[key],
                      "ts": round((span.start - origin) * 1e6, 3), "dur": round((span.end - span.start) * 1e6, 3),
                      "args": {"step": span.step, "steps": span.steps, "examples": span.examples, "job": span.job}})
    for event in events:
        trace.append({"ph": "i", "s": "p", "name": event.kind, "cat": "task", "pid": pids[event.task], "tid": 0,
                      "ts": round((event.time - origin) * 1e6, 3), "args": {"detail": event.detail, "job": event.job}})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"start_unix_s": origin, **({"title": title} if title else {})}}


def save_step_trace(spans: Iterable[StepSpan], path: str | Path, events: Iterable[TaskEvent] = (),
                    title: str = "") -> Path:
    """Write ``step_trace(...)`` as JSON to ``path`` (folders created); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(step_trace(spans, events, title)))
    return path


class JobTimeline:
    """One job's spans and task events as the telemetry log holds them (``job.timeline``)."""

    def __init__(self, log, job: str):
        self.log = log
        self.job = job

    def _recorded(self, kind: type | tuple[type, ...]) -> list:
        return [e for e in self.log.since(0).events if isinstance(e, kind) and e.job == self.job]

    def spans(self) -> list[StepSpan]:
        """The job's finished step spans still in the log (it keeps the newest 100,000 events of the cluster)."""
        return [span for span in self._recorded(StepSpan) if span.end is not None]

    def events(self) -> list[TaskEvent]:
        """The faults and health changes the job recorded."""
        return self._recorded(TaskEvent)

    def save(self, path: str | Path) -> Path:
        """Write the timeline as a Chrome trace JSON that ui.perfetto.dev and chrome://tracing open: a process
        per task, a thread per device, a slice per step phase, an instant per fault. Returns the path."""
        recorded = self._recorded((StepSpan, TaskEvent))  # one pass over the log
        return save_step_trace([e for e in recorded if isinstance(e, StepSpan)], path,
                               [e for e in recorded if isinstance(e, TaskEvent)], title=f"workbench job {self.job}")

    def __repr__(self) -> str:
        return f"<workbench JobTimeline of {self.job}: {len(self.spans())} spans; .save(path) writes a Perfetto trace>"
