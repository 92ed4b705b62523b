"""The engine pool and its TensorFlow roles."""

from .cluster import Cluster, running_clusters
from .registry import ClusterRecord, Endpoint, list_clusters
from .spec import TaskId
from .status import ClusterStatus, TaskRecord

__all__ = ["Cluster", "ClusterRecord", "ClusterStatus", "Endpoint", "TaskId", "TaskRecord", "list_clusters", "running_clusters"]
