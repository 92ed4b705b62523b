"""Telemetry: event records, the kernel-side ring buffer, step recorders and profiler traces."""

from .events import JobProgress, OpEvent, StepSpan, ThroughputSample
from .log import Batch, EventLog

__all__ = ["Batch", "EventLog", "JobProgress", "OpEvent", "StepSpan", "ThroughputSample"]
