"""Facts about the machine a process runs on: its GPUs (``gpus.py``), its memory and the container's
limit (``memory.py``), how TensorFlow's thread pools wait (``threads.py``), the versions of the installed software
(``versions.py``), and which process a pid names (``processes.py``).

The bottom of ``workbench.cluster``: imports nothing of the cluster, only ``workbench.errors``.
"""
