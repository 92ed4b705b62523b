"""ipyparallel internals the workbench uses, each behind one function here (checked on: ``compat.FENCES``).

Beside these, two subclasses rely on undocumented hooks of ipyparallel's classes, and say so where they are
defined: ``ForkEngineLauncher`` (its ``start`` makes the process as ``LocalProcessLauncher.start`` does, then
``watch_started_process``) and ``engine_main.ForkedEngine`` (its ``start_nanny`` asks the warm process for a
nanny, with ``IPEngine.start_nanny``'s arguments and return value).

- ``watch_started_process(launcher)``: a local launcher's thread that notices its process exit
  (``_start_waiting``), for a process the launcher did not start itself (forked by the warm process).
- ``computes_engine_command(cls)``: whether a launcher class works out its engine command itself, per host
  (``_engine_cmd_default``: the SSH launchers), rather than taking ``engine_cmd`` as given.
- ``run_nanny(pipe, **kwargs)``: an engine's nanny (``ipyparallel.engine.nanny.KernelNanny.main``), run in a
  process forked by the warm process, reporting its address on ``pipe``.
"""

from __future__ import annotations

from typing import Any


def watch_started_process(launcher: Any) -> None:
    """Start the launcher's watch of ``launcher.pid`` (its exit ends the launcher, as for a process it started)."""
    launcher._start_waiting()


def computes_engine_command(cls: type) -> bool:
    """Whether ``cls`` works out its engine command per host (SSH launchers) instead of using ``engine_cmd``."""
    return hasattr(cls, "_engine_cmd_default")


def run_nanny(pipe: Any, **kwargs: Any) -> None:
    """Run an engine's nanny in this process until the engine exits; its address goes to ``pipe``."""
    from ipyparallel.engine.nanny import KernelNanny

    KernelNanny.main(**kwargs, pipe=pipe)
