"""The keywords of earlier versions of ``wb.train`` and ``wb.estimate``, each with its new place (see CHANGELOG).

A keyword that moved onto a configuration object raises a ``TypeError`` that says where it went, rather than
Python's "unexpected keyword argument".
"""

from __future__ import annotations

import functools
from collections.abc import Callable

MOVED_ARGUMENTS = {
    "backup_workers": "strategy=wb.SyncPS(backup_workers=...)",
    "transfer": "strategy=wb.AsyncPS(transfer=...) (or wb.SyncPS(transfer=...))",
    "partition_bytes": "strategy=wb.AsyncPS(partition_bytes=...) (or wb.SyncPS(partition_bytes=...))",
    "elastic_batch": "strategy=wb.AsyncPS(elastic_batch=...) (or wb.SyncPS(elastic_batch=...))",
    "steps_per_call": "strategy=wb.AsyncPS(steps_per_call=...) (or the object of the strategy you train with)",
    "recover": "recovery=wb.Recovery(rehost=...) (recovery=None fails fast)",
    "step_timeout": "recovery=wb.Recovery(step_timeout=...)",
    "hang_timeout": "recovery=wb.Recovery(hang_timeout=...)",
    "on_hang": "recovery=wb.Recovery(on_hang=...)",
    "straggler_factor": "recovery=wb.Recovery(straggler_factor=...)",
    "on_straggler": "recovery=wb.Recovery(on_straggler=...)",
    "checkpoint_dir": "checkpoint=directory (or wb.Checkpoint(directory, every=..., resume=..., keep=...))",
    "checkpoint_every": "checkpoint=wb.Checkpoint(directory, every=...)",
    "resume": "checkpoint=wb.Checkpoint(directory, resume=True)",
    "log_dir": "callbacks=[keras.callbacks.TensorBoard(log_dir)] (the job adds its per-worker runs to that directory)",
    "wait": "wb.train(...).wait()",
}


def refusing_moved_arguments(label: str) -> Callable[[Callable], Callable]:
    """Decorate a function so that a keyword of an earlier version (``backup_workers=``, ``checkpoint_dir=``...)
    raises a ``TypeError`` naming its new place (see CHANGELOG); ``inspect.signature`` shows the function's own."""

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def checked(*args, **kwargs):
            for name in kwargs:
                if name in MOVED_ARGUMENTS:
                    raise TypeError(f"{label}: {name}= is now {MOVED_ARGUMENTS[name]}.")
            return function(*args, **kwargs)

        return checked

    return decorate
