"""What each TensorFlow process of the workbench gets: the kernel and every engine.

Owns keeping TensorFlow's ports off the network (``containment.py``: the bind shim ``bind_shim.c``,
compiled into ``workbench-bind-shim.so``, and what each process listens on; ``bind_hook.py``: the shim
in a process started without it), a process's own directory for autograph's generated files
(``client_files.py``), the kernel's one TensorFlow connection to a cluster (``connection.py``), and its scopes
on one task (``placing.py``).

May import ``..machine`` and ``workbench.errors``/``workbench.native_logs``; nothing above it.
"""
