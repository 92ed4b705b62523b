"""The JSON the server extension sends to the JupyterLab panel, defined once (a contract test checks it)."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from ..cluster.registry import ClusterRecord


@dataclass(frozen=True)
class TaskInfo:
    name: str  # "worker:0"
    job: str
    index: int
    engine_id: int
    host: str
    address: str
    pid: int
    devices: list[str]
    gpus: list[str]
    state: str  # starting | running | silent | lost | recovering | stopped
    note: str = ""  # why it is in that state ("its engine exited", "re-hosted on engine 3")
    restarts: int = 0  # times the task was re-hosted on a new engine


@dataclass(frozen=True)
class ClusterInfo:
    name: str
    state: str
    engines: str  # the launcher: local, slurm, mpi, ..., existing
    owned: bool  # the workbench started the engines (else it borrowed an existing pool)
    client_pid: int  # the kernel or process that runs the cluster
    tasks: list[TaskInfo]
    dashboard: str | None  # URL of the owner's dashboard server (127.0.0.1), or None
    updated: float
    controllable: bool = False  # the owner answers scale/stop/dashboards (workbench >= 0.1 with a control endpoint)
    owned_here: bool = False  # started from the panel: this Jupyter server owns it
    workbench_version: str = ""
    spec: dict[str, list[str]] = field(default_factory=dict)
    network: str = ""  # the emulated links between tasks and their shaping ("" without network=)
    job: str = ""  # the owner's job running now, "" when none (its figures: the summary route)

    @classmethod
    def from_record(cls, record: ClusterRecord, owned_here: bool = False) -> ClusterInfo:
        """A registry record (written by ``Cluster``) -> the panel's view of it."""
        tasks = [TaskInfo(name=t.name, job=t.job, index=t.index, engine_id=t.engine_id, host=t.host, address=t.address,
                          pid=t.pid, devices=list(t.devices), gpus=list(t.gpus), state=t.state, note=t.note,
                          restarts=t.restarts) for t in record.tasks]
        dashboard = record.endpoints.get("dashboard")
        return cls(name=record.name, state=record.state, engines=record.engines, owned=record.owned,
                   client_pid=record.client_pid, tasks=tasks, dashboard=dashboard.url if dashboard else None,
                   updated=record.updated, workbench_version=record.workbench_version, spec=dict(record.spec),
                   controllable="control" in record.endpoints, owned_here=owned_here, network=record.network,
                   job=record.job)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PlotLink:
    """One plot of a cluster, as the panel opens it: ``path`` is served through this Jupyter server."""

    name: str  # timeline, throughput, progress, dashboard, profile
    title: str
    path: str  # <base_url>workbench/dashboards/<cluster>/<name>

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


ENGINE_LAUNCHERS = ("local", "mpi", "slurm", "ssh", "pbs", "sge", "lsf", "htcondor")


@dataclass(frozen=True)
class StartForm:
    """The panel's "new cluster" form (``POST /workbench/api/clusters``)."""

    ps: int = 1
    workers: int = 2
    gpus_per_worker: int = 0
    engines: str = "local"  # an ipyparallel engine launcher
    profile: str = ""  # an ipyparallel profile holding that launcher's configuration
    name: str | None = None
    controller_ip: str = ""  # an address of this machine the engines can reach ("": the launcher's default)
    queue: str = ""  # batch launchers: the partition or queue
    account: str = ""  # batch launchers: the account charged
    timelimit: str = ""  # batch launchers: the engines' time limit (HH:MM:SS)
    options: str = ""  # any other option of the launcher: KEY=VALUE, one a line (a Python literal, or text)

    @classmethod
    def parse(cls, body: Any) -> StartForm:
        """Check the form's fields; raise ``ConfigurationError`` naming the field and what is allowed."""
        from ..errors import ConfigurationError

        if not isinstance(body, dict):
            raise ConfigurationError("send the form as a JSON object: {\"ps\": 1, \"workers\": 2, ...}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ConfigurationError(f"unknown field(s) {unknown}: the form has {sorted(known)}.")
        values = {**asdict(cls()), **body}
        for key, low in (("ps", 0), ("workers", 1), ("gpus_per_worker", 0)):
            value = values[key]
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 64:
                raise ConfigurationError(f"{key}={value!r}: an integer from {low} to 64.")
        if values["engines"] not in ENGINE_LAUNCHERS:
            raise ConfigurationError(f"engines={values['engines']!r}: one of {', '.join(ENGINE_LAUNCHERS)}.")
        if not isinstance(values["profile"], str):
            raise ConfigurationError(f"profile={values['profile']!r}: the name of an ipyparallel profile, or ''.")
        for key in ("controller_ip", "queue", "account", "timelimit", "options"):
            if not isinstance(values[key], str):
                raise ConfigurationError(f"{key}={values[key]!r}: text, or '' for none.")
        if values["name"] in ("", None):
            values["name"] = None
        elif not isinstance(values["name"], str):
            raise ConfigurationError(f"name={values['name']!r}: a cluster name, or leave it empty for a random one.")
        return cls(**values)

    def launcher_options(self) -> dict[str, Any]:
        """What ``wb.Cluster`` takes besides the counts: the profile, the named options given, and the others
        (``ConfigurationError`` for a line that is not KEY=VALUE)."""
        from ..cluster.launch.launchers import parse_launcher_options

        named = {key: getattr(self, key) for key in ("profile", "queue", "account", "timelimit") if getattr(self, key)}
        return {**named, **parse_launcher_options(self.options.splitlines())}


@dataclass(frozen=True)
class WorkerRates:
    examples_per_s: float
    steps_per_s: float


@dataclass(frozen=True)
class JobNow:
    """The newest job of a cluster at a glance (``GET .../clusters/<name>/summary``, the panel's live figure)."""

    job: str
    strategy: str
    state: str  # running | stopping | finished | failed | cancelled (workbench.cluster.jobs)
    steps_done: int
    steps_total: int
    fraction: float
    eta_s: float | None
    elapsed_s: float
    notes: list[str]
    examples_per_s: float
    steps_per_s: float
    workers: dict[str, WorkerRates]
    transfer: str = ""  # ps strategies: the precision parameters and gradients travel in ("" from older owners)
    bytes_per_step: int = 0  # what one worker's step moves to and from the ps tasks (0: not known)
    queued: list[str] = field(default_factory=list)  # the jobs waiting for the cluster, one line each, oldest first
    running: list[str] = field(default_factory=list)  # other jobs training now (another kernel's), one line each
    # over the job's counted steps so far; an ended job's examples_per_s / steps_per_s are these
    average_examples_per_s: float = 0.0
    average_steps_per_s: float = 0.0

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> JobNow:
        """Checks an owner's answer against this shape (a ``KeyError``/``TypeError`` if it drifted).

        Fields with a default may be missing: an owner running an older workbench does not send them.
        """
        known = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        if not required <= set(body) <= known:
            raise TypeError(f"summary fields {sorted(body)} differ from JobNow's {sorted(known)}")
        return cls(**{**body, "workers": {w: WorkerRates(**r) for w, r in body["workers"].items()}})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ErrorBody:
    """Every 4xx answer: what failed, and what to do."""

    error: str
    status: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
