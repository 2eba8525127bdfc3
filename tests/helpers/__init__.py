"""Code shared by the tests: ``from helpers import pipeline``, ``from helpers.data import ...``
(``tests/`` is on ``sys.path``: ``pythonpath`` in pyproject.toml's pytest section; a process a test
starts gets it through ``PYTHONPATH``)."""
