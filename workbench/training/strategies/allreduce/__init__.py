"""all-reduce: MultiWorkerMirroredStrategy on the worker engines. The kernel's side (``trainer.py``: ``AllReduceTrainer``), the group of
engines it calls together and what travels to them (``group.py``), what runs on them (``engine.py``), and a cell
run on every worker at once (``spmd.py``: ``%%wb spmd``)."""
