#!/usr/bin/env bash
# Create .venv (Python 3.11) with the pinned versions CI passed with. Idempotent: a second
# run with unchanged pyproject.toml / constraints.txt does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python >= 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

# tcmalloc makes the JAX CPU step ~1.3x faster (see docs/benchmarks.md); installed when we can.
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1)) \
    || echo "setup: could not install libtcmalloc-minimal4; continuing without it" >&2
fi

# A C++ compiler builds the native CPU attention kernel at first use (XLA's attention without one);
# the tests of that kernel need it, and fail under CI=true without it.
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q g++ >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q g++ >/dev/null 2>&1)) \
    || echo "setup: could not install g++; CPU training keeps XLA's attention" >&2
fi

stamp=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ -x .venv/bin/python ] && [ "$(cat .venv/.lm_pipeline_stamp 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]"
echo "$stamp" > .venv/.lm_pipeline_stamp
echo "setup: .venv ready ($(.venv/bin/python --version))"
