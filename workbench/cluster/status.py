"""Records of a cluster's tasks and their rendering as a text table and as HTML."""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field

from ..tables import text_table
from .spec import TaskId


@dataclass
class TaskRecord:
    """One TensorFlow task and the engine hosting it."""

    job: str
    index: int
    engine_id: int
    host: str
    address: str = ""
    pid: int = 0
    devices: list[str] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES of the engine
    state: str = "starting"  # starting | running | silent | lost | recovering | stopped (see health.py)
    tensorflow: str = ""
    since: float = 0.0  # when the task entered its state (seconds since the epoch)
    note: str = ""  # why it is in that state, or what it is doing about it
    restarts: int = 0  # times the task was re-hosted on a new engine after its engine was lost

    @property
    def task(self) -> TaskId:
        return TaskId(self.job, self.index)

    @property
    def name(self) -> str:
        return str(self.task)

    def to_dict(self) -> dict:
        return asdict(self)


_COLUMNS = ("task", "engine", "host", "address", "pid", "devices", "GPUs", "state")


def _device_summary(record: TaskRecord) -> str:
    kinds = [d.rsplit("/device:", 1)[-1] for d in record.devices]
    return ", ".join(kinds) if kinds else "-"


def _state(record: TaskRecord) -> str:
    """``running``; ``lost (its engine exited)``; ``running, re-hosted 1x``."""
    text = record.state
    if record.note and record.state != "running":
        text += f" ({record.note})"
    if record.restarts:
        text += f", re-hosted {record.restarts}x"
    return text


def _row(record: TaskRecord) -> tuple[str, ...]:
    return (
        record.name,
        str(record.engine_id),
        record.host or "-",
        record.address or "-",
        str(record.pid or "-"),
        _device_summary(record),
        ",".join(record.gpus) if record.gpus else "none",
        _state(record),
    )


@dataclass
class ClusterStatus:
    """What ``Cluster.status()`` returns: printable in a terminal, rich HTML in a notebook."""

    name: str
    state: str
    launcher: str
    tasks: list[TaskRecord]
    network: str = ""  # the emulated links and their shaping, "" without network=
    jobs: tuple[str, ...] = ()  # one line per job that runs or waits (JobQueue), the running one first
    log_path: str = ""  # where TensorFlow's, absl's and gRPC's own lines of this kernel go (``Cluster.log_path``)

    def _header(self) -> str:
        counts = {job: sum(t.job == job for t in self.tasks) for job in ("ps", "worker")}
        return (
            f"cluster {self.name!r}: {self.state}, {counts['ps']} ps + {counts['worker']} worker "
            f"task(s), engines: {self.launcher}"
        )

    def __str__(self) -> str:
        table = text_table(_COLUMNS, [_row(t) for t in self.tasks], title=self._header())
        lines = [table] + ([f"links: {self.network}"] if self.network else []) + [f"job: {j}" for j in self.jobs]
        return "\n".join(lines + ([f"native logs: {self.log_path}"] if self.log_path else []))

    __repr__ = __str__

    def _repr_html_(self) -> str:
        colours = {"running": "#2e7d32", "starting": "#f9a825", "silent": "#ef6c00", "lost": "#c62828",
                   "recovering": "#1565c0", "stopped": "#757575"}
        head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in _COLUMNS)
        body = []
        for record in self.tasks:
            cells = list(_row(record))
            state = cells[-1]
            cells = [html.escape(c) for c in cells[:-1]]
            badge = f"<span style='color:{colours.get(record.state, '#000')};font-weight:bold'>● {html.escape(state)}</span>"
            body.append("<tr>" + "".join(f"<td style='text-align:left'>{c}</td>" for c in cells) + f"<td>{badge}</td></tr>")
        return (
            f"<div class='workbench-cluster'><p><b>{html.escape(self._header())}</b></p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
            + (f"<p class='workbench-links'>links: {html.escape(self.network)}</p>" if self.network else "")
            + "".join(f"<p class='workbench-job'>job: {html.escape(j)}</p>" for j in self.jobs)
            + (f"<p class='workbench-logs' style='color:#777'>native logs: {html.escape(self.log_path)}</p>"
               if self.log_path else "")
            + "</div>"
        )
