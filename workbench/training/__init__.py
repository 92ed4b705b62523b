"""Distributed training driven from the notebook kernel."""

from .api import train
from .data import DataContext
from .job import Job, ParameterServerLost, TrainingError

__all__ = ["DataContext", "Job", "ParameterServerLost", "TrainingError", "train"]
