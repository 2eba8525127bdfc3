#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the default test tier. Extra arguments go to pytest.
#
# The tier runs on one pytest-xdist worker per core (at most 4; LM_PIPELINE_TEST_WORKERS sets the
# number, 0 runs in one process): much of a test's time is a single-threaded XLA compile, which a
# second worker overlaps. --dist loadfile keeps each file's tests on one worker, in their order.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n "${LM_PIPELINE_TEST_WORKERS:-auto}" --maxprocesses 4 --dist loadfile "$@"
