"""Browser tests (a package so that its conftest.py does not shadow tests/conftest.py as ``conftest``)."""
