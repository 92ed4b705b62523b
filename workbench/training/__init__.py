"""Distributed training driven from the notebook kernel."""

from .allreduce import WorkerOutput, run_spmd
from .api import train
from .data import DataContext
from .job import Job, ParameterServerLost, TrainingError
from .model_parallel import PlacedModel, Placement, place, placement

__all__ = ["WorkerOutput", "run_spmd", "DataContext", "Job", "ParameterServerLost", "Placement", "PlacedModel", "TrainingError",
           "place", "placement", "train"]
