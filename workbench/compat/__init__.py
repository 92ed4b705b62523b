"""What the workbench takes from other libraries' internals, fenced: one module per library.

Each entry names the versions it was checked on; a version outside them keeps the library's own behaviour.
"""
