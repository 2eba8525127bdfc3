#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the default test tier. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
