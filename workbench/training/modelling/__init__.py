"""The Keras and TensorFlow glue every strategy shares: what a job builds from the user's arguments.

Owns: building the model and optimizer (``building.py``: seeded initial weights, the compiled
model's settings, updates where a variable lives), losses and per-batch metrics (``losses.py``),
where variables live (``placement.py``: the ps placer, partitioned variables), and the step
functions a worker runs (``steps.py``: several steps per call, timestamps, the placed model's
gradients).

May import: the training package's options and the compat fence; no other room.
"""
