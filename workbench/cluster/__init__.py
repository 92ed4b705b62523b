"""The engine pool and its TensorFlow roles."""

from .cluster import Cluster, running_clusters
from .registry import list_clusters
from .spec import TaskId
from .status import ClusterStatus, TaskRecord

__all__ = ["Cluster", "ClusterStatus", "TaskId", "TaskRecord", "list_clusters", "running_clusters"]
