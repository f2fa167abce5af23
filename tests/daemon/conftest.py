"""Daemon tests: the daemons and models they share come from ``tests/conftest.py`` and
:mod:`tests.daemons`."""
