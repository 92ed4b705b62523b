"""The emulated network between a cluster's tasks: links a user can shape while training runs.

Owns the rules and their parsing (``shaping.py``: rates, delays, which links), and the two back ends
that carry them: a network namespace per task shaped by ``tc`` (``netns.py``, root) and a user-space
relay process (``relay.py``, no root). The cluster's face holds them through ``..links``.

May import ``..process`` and ``..machine`` and ``workbench.errors``; never the face nor ``..launch``.
"""
