"""How engines start, live and stop: the ipyparallel side of a cluster.

Owns the engine pool (``pool.py``: a cluster's own controller and engines; ``borrowed.py``: engines
it borrows and never stops), which launcher starts them and with which options (``launchers.py``),
calls on engines bounded by a deadline (``calls.py``), the warm process that imports TensorFlow once
and forks engines (``warm.py``; ``warm_client.py``, what engines and the launcher ask of it;
``fork_launcher.py``, the ipyparallel launcher ``workbench-fork``; ``engine_main.py``, an engine's
entry point), what runs on an engine to give it its TensorFlow task (``engine_side.py``), the
lifeline and the reaper that clean up after a killed client (``lifeline.py``, ``reaper.py``), and
what the batch and remote launchers need (``mpi.py``, ``batch.py``, ``placement_hosts.py``).

May import ``..process`` and ``..machine`` (below it) and ``workbench.errors``; never the cluster's face
(``..cluster``, ``..hosting``, ...) nor ``..network``.
"""
