"""Entry point of a workbench engine: ipyparallel's ``ipengine`` with four things done first.

0. **Contained ports.** An engine started as a new process (Slurm, MPI, SSH, or locally without
   forking) runs again at once with the bind shim loaded (``containment``), so that its TensorFlow
   servers listen only on the address its ClusterSpec names. Forked engines have it already.
1. **Lifeline.** The engine connects to its client's reaper and exits as soon as that
   connection closes, so an engine never outlives a client that was killed (SIGKILL, a
   crashed kernel), wherever the engine runs (local, Slurm, MPI, SSH).
2. **Early TensorFlow import.** For CPU-only pools the engine starts ``import tensorflow``
   in a thread while it registers with the controller, so the 5-30 s import overlaps
   start-up instead of following it. Pools that assign GPUs skip this: ``CUDA_VISIBLE_DEVICES``
   has to be set per engine before TensorFlow loads. (An engine forked from the warm process
   has TensorFlow already; the thread then finds it imported.)
3. **Nanny from the warm process.** An engine forked from the warm process (``WARM_SOCKET_ENV``
   set) has its ipyparallel nanny forked there too, instead of starting a fresh Python for it.

Run as ``python -m workbench.cluster.launch.engine_main [ipengine arguments]``; the warm process calls
``main(args)`` in each engine it forks.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

from ..machine.gpus import ORIGINAL_VISIBLE_ENV
from ..process import client_files, containment
from .lean_import import import_tensorflow
from .lifeline import LIFELINE_ENV, PREIMPORT_ENV, hold_lifeline

WARM_SOCKET_ENV = "WORKBENCH_WARM_SOCKET"
# Engines started on another host by one command (engines='ssh'): this process imports TensorFlow
# once, then forks the others, so that a host's engines share that import as local ones do.
FORKS_ENV = "WORKBENCH_ENGINE_FORKS"
_SHIM_TRIED_ENV = "WORKBENCH_BIND_SHIM_TRIED"  # set before re-running with the shim: never twice
ENGINE_MAIN = [sys.executable, "-m", "workbench.cluster.launch.engine_main"]  # the command of an engine that is not forked
# gRPC honours these; cluster traffic must never go through a proxy.
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY")


def _preimport_tensorflow() -> None:
    try:
        import_tensorflow()  # as the warm process does: what Keras loads for a kernel's sake left out
    except BaseException:  # noqa: BLE001 - the client's own import on this engine reports it
        pass


def hide_gpus_for_cpu_pool() -> None:
    """Hide every GPU from TensorFlow, remembering what the scheduler had made visible."""
    if ORIGINAL_VISIBLE_ENV in os.environ:
        return  # hidden already (before forking siblings)
    original = os.environ.get("CUDA_VISIBLE_DEVICES")
    if original is not None:
        os.environ[ORIGINAL_VISIBLE_ENV] = original
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


@functools.cache
def engine_app_class() -> type:
    """ipyparallel's ``IPEngine``, or a subclass whose nanny is forked by the warm process."""
    from ipyparallel.engine.app import IPEngine

    from .warm_client import WarmError, start_forked_nanny

    class ForkedEngine(IPEngine):
        def start_nanny(self, control_url):
            from traitlets.config import Config

            config = Config()
            config.Session = self.config.Session
            kwargs = dict(engine_id=self.id, identity=self.bident, control_url=control_url,
                          curve_serverkey=self.curve_serverkey, curve_secretkey=self.curve_secretkey,
                          curve_publickey=self.curve_publickey, registration_url=self.registration_url, config=config)
            try:
                return start_forked_nanny(os.environ[WARM_SOCKET_ENV], kwargs)
            except (WarmError, OSError) as exc:
                self.log.warning("starting the nanny as a new process: %s", exc)
                return super().start_nanny(control_url)

    return ForkedEngine if os.environ.get(WARM_SOCKET_ENV) else IPEngine


def _fork_siblings(count: int, args: list[str]) -> None:
    """Become one of ``count`` engines: import TensorFlow once, then fork the other ``count - 1``.

    Each fork goes on as an engine of its own (its own lifeline, registration and nanny). Only for
    CPU-only pools (GPUs must be chosen per engine before TensorFlow loads); where forking is unsafe
    (a thread running, a GPU driver loaded) the others start as new processes instead.
    """
    if count <= 1:
        return
    import subprocess

    from .warm_client import fork_problem

    problem = "GPUs are chosen per engine"
    if os.environ.get(PREIMPORT_ENV) == "1":
        hide_gpus_for_cpu_pool()
        _preimport_tensorflow()
        problem = fork_problem()
    for _ in range(count - 1):
        if problem:
            subprocess.Popen([sys.executable, "-m", "workbench.cluster.launch.engine_main", *args], start_new_session=True)
        elif os.fork() == 0:
            return  # the child: an engine like its parent, sharing the import


def run_with_bind_shim(args: list[str]) -> None:
    """Run this engine again with the bind shim loaded, unless it is loaded, unwanted or unavailable (then say so)."""
    if containment.shim_loaded() or os.environ.get(containment.BIND_ENV) == containment.EVERY_INTERFACE:
        return
    problem = "the bind shim did not load" if os.environ.get(_SHIM_TRIED_ENV) else ""
    if os.environ.get(WARM_SOCKET_ENV):  # a fork: running again would throw away what it shares with the warm process
        problem = os.environ.get(containment.PROBLEM_ENV) or "the warm process it was forked from runs without the shim"
    if not problem:
        env, problem = containment.preload_env(dict(os.environ))
    if problem:
        os.environ.setdefault(containment.PROBLEM_ENV, problem)
        print(f"workbench engine: {problem}; TensorFlow's ports will listen on every interface", file=sys.stderr, flush=True)
        return
    env[_SHIM_TRIED_ENV] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "workbench.cluster.launch.engine_main", *args], env)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    run_with_bind_shim(args)
    for name in _PROXY_VARIABLES:
        os.environ.pop(name, None)
    # A task's receive from a peer that died must fail, not wait for the peer to come back: with
    # gRPC's default (wait for ready), a ps receiving a gradient from a killed worker blocks, and
    # with it every later call this client makes on that ps. A user's own setting wins.
    os.environ.setdefault("GRPC_FAIL_FAST", "true")
    _fork_siblings(int(os.environ.pop(FORKS_ENV, "1") or 1), args)
    client_files.sweep()  # what engines killed on this host before left behind
    client_files.adopt_temporary_directory()  # this engine's own: killed at stop, it cleans up nothing itself
    lifeline = os.environ.get(LIFELINE_ENV)
    if lifeline:
        hold_lifeline(lifeline)
    app_class = engine_app_class()
    if os.environ.get(PREIMPORT_ENV) == "1":
        hide_gpus_for_cpu_pool()
        if "tensorflow" not in sys.modules:
            threading.Thread(target=_preimport_tensorflow, name="workbench-preimport", daemon=True).start()
    sys.argv = [sys.argv[0], *args]
    app_class.launch_instance(args)


if __name__ == "__main__":
    main()
