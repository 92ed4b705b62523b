"""What both parameter-server strategies share: ``PsTrainer`` (``trainer.py``: the variables on the ps tasks, one
input pipeline per worker, checkpoints, following a scale), a run's worker slots and what it does about
failing tasks (``runs.py``), and packed transfers in their precision (``packing.py``)."""
