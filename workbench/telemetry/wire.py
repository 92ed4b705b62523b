"""Job events as JSON, for a process that trains on a cluster it does not own (``wb.attach``).

The owner's telemetry log is what its dashboards, its summary route and so the JupyterLab panel read.
An attached process sends its jobs' step spans, completed steps and progress there (``encode``), and
the owner's control endpoint appends them (``decode``). Job names are per process ("async-ps-1" in
both), so the sender names its jobs with its pid.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .events import JobProgress, StepDone, StepSpan

KINDS = {cls.__name__: cls for cls in (StepSpan, StepDone, JobProgress)}
MAX_EVENTS = 50_000  # one request's events at most


def encode(events, sender: str) -> list[dict[str, Any]]:
    """The job events of ``events`` as JSON-ready dicts, each job named ``"<job> (<sender>)"``."""
    return [{"kind": type(e).__name__, **dataclasses.asdict(e), "job": f"{e.job} ({sender})"}
            for e in events if type(e).__name__ in KINDS and getattr(e, "job", "")]


def decode(items: Any) -> list:
    """Events from ``encode``'s dicts; ``ValueError`` (what is wrong) for anything else."""
    if not isinstance(items, list) or len(items) > MAX_EVENTS:
        raise ValueError(f"send a list of at most {MAX_EVENTS} events")
    events = []
    for item in items:
        cls = KINDS.get(item.get("kind")) if isinstance(item, dict) else None
        if cls is None:
            raise ValueError(f"unknown event {str(item)[:80]!r}: send StepSpan, StepDone or JobProgress dicts")
        fields = {f.name: item[f.name] for f in dataclasses.fields(cls) if f.name in item}
        for name in ("workers",):  # tuples travel as lists
            if isinstance(fields.get(name), list):
                fields[name] = tuple(fields[name])
        try:
            events.append(cls(**fields))
        except TypeError as exc:
            raise ValueError(f"a {cls.__name__} with fields {sorted(item)}: {exc}") from None
    return events
