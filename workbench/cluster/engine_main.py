"""Entry point of a workbench engine: ipyparallel's ``ipengine`` with two things done first.

1. **Lifeline.** The engine connects to its client's reaper and exits as soon as that
   connection closes, so an engine never outlives a client that was killed (SIGKILL, a
   crashed kernel), wherever the engine runs (local, Slurm, MPI, SSH).
2. **Early TensorFlow import.** For CPU-only pools the engine starts ``import tensorflow``
   in a thread while it registers with the controller, so the 5-30 s import overlaps
   start-up instead of following it. Pools that assign GPUs skip this: ``CUDA_VISIBLE_DEVICES``
   has to be set per engine before TensorFlow loads.

Run as ``python -m workbench.cluster.engine_main [ipengine arguments]``.
"""

from __future__ import annotations

import os
import sys
import threading

from .gpus import ORIGINAL_VISIBLE_ENV
from .lifeline import LIFELINE_ENV, PREIMPORT_ENV, hold_lifeline

# gRPC honours these; cluster traffic must never go through a proxy.
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "grpc_proxy", "HTTP_PROXY", "HTTPS_PROXY")


def _preimport_tensorflow() -> None:
    try:
        import tensorflow  # noqa: F401
    except BaseException:  # noqa: BLE001 - the client's own import on this engine reports it
        pass


def hide_gpus_for_cpu_pool() -> None:
    """Hide every GPU from TensorFlow, remembering what the scheduler had made visible."""
    original = os.environ.get("CUDA_VISIBLE_DEVICES")
    if original is not None:
        os.environ[ORIGINAL_VISIBLE_ENV] = original
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def main(argv: list[str] | None = None) -> None:
    for name in _PROXY_VARIABLES:
        os.environ.pop(name, None)
    # A task's receive from a peer that died must fail, not wait for the peer to come back: with
    # gRPC's default (wait for ready), a ps receiving a gradient from a killed worker blocks, and
    # with it every later call this client makes on that ps. A user's own setting wins.
    os.environ.setdefault("GRPC_FAIL_FAST", "true")
    lifeline = os.environ.get(LIFELINE_ENV)
    if lifeline:
        hold_lifeline(lifeline)
    from ipyparallel.engine.app import main as ipengine_main

    if os.environ.get(PREIMPORT_ENV) == "1":
        hide_gpus_for_cpu_pool()
        threading.Thread(target=_preimport_tensorflow, name="workbench-preimport", daemon=True).start()
    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    ipengine_main()


if __name__ == "__main__":
    main()
