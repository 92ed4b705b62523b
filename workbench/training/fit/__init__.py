"""The Keras fit loop of a job: epochs, validation, callbacks and the TensorBoard runs.

Owns: ``EpochLoop`` (``loop.py``: which steps belong to the current epoch, the callbacks' hooks
called as ``model.fit`` calls them, ``keras_history``, early stopping) and evaluation
(``evaluation.py``: a dataset in this kernel, a data function on the workers, their results
combined). It knows no strategy: what differs (the callbacks' model, validating on the workers) the
job asks its strategy for.

May import: ``modelling/`` and the training package's data; never ``job/`` or ``strategies/``.
"""
