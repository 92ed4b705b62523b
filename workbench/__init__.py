"""workbench: interactive distributed training for TensorFlow on ipyparallel engine pools."""

from . import (
    control,  # noqa: F401 - imported for its effect: clusters this process starts serve their control endpoint
    datasets,
)
from ._version import DISTRIBUTION, __version__
from .cluster import Cluster, ClusterStatus, TaskId, TaskRecord, list_clusters, running_clusters
from .cluster.launch.batch import slurm_reachable
from .dashboard import Dashboard, DashboardServer, dashboard, serve_dashboard
from .training import (
    AllReduce,
    AsyncPS,
    CallbackError,
    Checkpoint,
    DataContext,
    Estimate,
    Job,
    ModelParallel,
    ParameterServerLost,
    PlacedModel,
    Placement,
    Recovery,
    Strategy,
    SyncPS,
    TrainingError,
    estimate,
    place,
    placement,
    run_spmd,
    train,
)

attach = Cluster.attach

from . import (  # noqa: E402
    native_logs,
    tracking,  # wb.tracking.MLflow, wb.tracking.WandB (loaded on first use)
)
from .cluster.machine.gpus import let_kernel_memory_grow  # noqa: E402
from .cluster.machine.memory import cap_malloc_arenas  # noqa: E402

let_kernel_memory_grow()  # before the user's first TensorFlow op: the kernel must not reserve its GPUs' memory
cap_malloc_arenas()  # a script's threads share two heaps, so it stays lean job after job (a kernel: workbench.kernel)

native_logs.route()  # in a notebook kernel, TensorFlow's and gRPC's C++ log lines go to a log file, not into cells

from . import compat  # noqa: E402

compat.warn_unchecked()  # a library whose internals the workbench uses, at a version they were not checked on

from .errors import (  # noqa: E402
    ClusterStartError,
    ClusterStateError,
    ConfigurationError,
    ControllerLost,
    EngineForkWarning,
    EngineStartTimeout,
    ExposedPortsWarning,
    LauncherOptionsWarning,
    LowMemoryWarning,
    ServerStartError,
    TaskFaultWarning,
    TensorFlowImportError,
    TrackingWarning,
    UncheckedVersionWarning,
    UnknownTaskError,
    VersionMismatchError,
    WorkbenchError,
    WorkbenchWarning,
)

__all__ = [
    "__version__",
    "DISTRIBUTION",
    "attach",
    "tracking",
    "datasets",
    "Dashboard",
    "DashboardServer",
    "dashboard",
    "serve_dashboard",
    "DataContext",
    "Estimate",
    "estimate",
    "Job",
    "ParameterServerLost",
    "PlacedModel",
    "Placement",
    "TrainingError",
    "CallbackError",
    "place",
    "placement",
    "run_spmd",
    "train",
    "AsyncPS",
    "SyncPS",
    "AllReduce",
    "ModelParallel",
    "Strategy",
    "Recovery",
    "Checkpoint",
    "Cluster",
    "ClusterStartError",
    "ClusterStateError",
    "ClusterStatus",
    "ConfigurationError",
    "ControllerLost",
    "EngineForkWarning",
    "LauncherOptionsWarning",
    "EngineStartTimeout",
    "ExposedPortsWarning",
    "LowMemoryWarning",
    "ServerStartError",
    "TaskId",
    "TaskFaultWarning",
    "TrackingWarning",
    "UncheckedVersionWarning",
    "TaskRecord",
    "TensorFlowImportError",
    "UnknownTaskError",
    "VersionMismatchError",
    "WorkbenchError",
    "WorkbenchWarning",
    "list_clusters",
    "running_clusters",
    "slurm_reachable",
]


def load_ipython_extension(ipython) -> None:
    """``%load_ext workbench``: the ``%wb`` / ``%%wb`` magics."""
    from .magics import load_ipython_extension as load

    load(ipython)
