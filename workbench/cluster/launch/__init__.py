"""How engines start, live and stop: the ipyparallel side of a cluster.

Owns the engine pool (``pool.py``: owned or borrowed engines, remote calls with deadlines), the warm
process that imports TensorFlow once and forks engines (``warm.py``, ``fork_launcher.py``,
``engine_main.py``), what runs on an engine to give it its TensorFlow task (``engine_side.py``), the
lifeline and the reaper that clean up after a killed client (``lifeline.py``, ``reaper.py``), and what
the batch and remote launchers need (``mpi.py``, ``batch.py``, ``placement_hosts.py``).

May import ``..process`` and ``..machine`` (below it) and ``workbench.errors``; never the cluster's face
(``..cluster``, ``..hosting``) nor ``..network``.
"""
