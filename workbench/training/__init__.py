"""Distributed training driven from the notebook kernel."""

from ..errors import ParameterServerLost, TrainingError
from .api import train
from .config import AllReduce, AsyncPS, Checkpoint, ModelParallel, Recovery, Strategy, SyncPS, strategy_named
from .data import DataContext
from .estimate import Estimate, estimate
from .fit.loop import CallbackError
from .job.job import Job
from .placing import PlacedModel, Placement, place, placement
from .strategies.allreduce.spmd import WorkerOutput, run_spmd

__all__ = ["AllReduce", "AsyncPS", "CallbackError", "Checkpoint", "ModelParallel", "Recovery", "Strategy", "SyncPS",
           "WorkerOutput", "run_spmd", "DataContext", "Estimate", "estimate", "Job", "ParameterServerLost", "Placement",
           "PlacedModel", "TrainingError", "place", "placement", "strategy_named", "train"]
