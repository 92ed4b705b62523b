"""A job's step records: what one step's record holds, the rate its records say, and the layout every job reports."""

from __future__ import annotations

from ...errors import TrainingError


def make_step_record(step: int, loss: float, metrics, metric_names: list[str], worker: str, start: float, end: float,
                examples: int, recovery: int, **extra) -> dict:
    """One step of ``job.history``: plain Python numbers (numpy scalars print as ``np.float64(...)``)."""
    return {
        "step": step,
        "loss": float(loss),
        **{name: float(v) for name, v in zip(metric_names, metrics)},
        "worker": worker,
        "start": float(start),
        "end": float(end),
        "examples": int(examples),
        "examples_per_s": float(examples / max(float(end) - float(start), 1e-9)),
        "recovery": recovery,
        **{key: value.item() if hasattr(value, "item") else value for key, value in extra.items()},
    }


def throughput_of(history: list[dict], warmup: int) -> dict[str, float]:
    """Steps/s and examples/s over ``history`` after its first ``warmup`` steps (by end), on the workers' clocks:
    from the first counted step's start to the last one's end."""
    records = sorted(history, key=lambda r: r["end"])[warmup:]
    if len(records) < 2:
        raise TrainingError(f"throughput needs at least 2 steps after warmup={warmup}; the job has "
                            f"{len(history)}: train longer or lower warmup.")
    seconds = max(records[-1]["end"] - min(r["start"] for r in records), 1e-9)
    return {"steps_per_s": len(records) / seconds, "examples_per_s": sum(r["examples"] for r in records) / seconds,
            "seconds": seconds, "steps": len(records)}


def layout_of(job) -> dict:
    """What ``job.info`` says of every job, whatever its strategy (its trainer adds its own)."""
    options = job.options
    return {
        "strategy": options.strategy.name,
        "steps": options.steps,
        "start_step": job.start_step,
        "global_batch_size": options.batch_size,
        "per_worker_batch_size": options.per_worker_batch,
        "workers": [r.name for r in job.workers],
        "backup_workers": options.strategy.backup_workers,
        "gradients_per_step": options.strategy.gradients_per_step(len(job.workers)),
        "checkpoint_dir": options.checkpoint.directory if options.checkpoint else None,
        "recover": options.recovery.rehost,
        "transfer": options.strategy.transfer,
        "bytes_per_step": job.trainer.bytes_per_step(),
    }
