"""The job's life, whatever its strategy: ``Job`` (``wb.Job``) from submission to its end.

Owns: the queue turn, the job's own thread (``driver.py``: set up, train, restore after a lost task,
end, hand the cluster on), its states, the step records (``history``), the checkpoint cadence, the
events of a scale it follows, and what it does when a task fails (``recovery.py``: the
``Supervisor`` turning health events into faults, ``classify``, ``restore_after_loss``). ``workers.py``
holds what every worker thread of a job shares (its executor, its devices, waiting with a give-up).

May import: ``fit/`` (the epoch loop a job runs its callbacks in), ``modelling/``, and the training
package's options, config and data; never ``strategies/``, which build on this room.
"""
