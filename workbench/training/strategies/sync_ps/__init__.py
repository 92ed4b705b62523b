"""sync-ps with backup workers: the barrier and gradient queue on the first ps (``steps.py``: the aggregate
call and the workers' step functions) and the run that drives them from the kernel (``run.py``)."""
