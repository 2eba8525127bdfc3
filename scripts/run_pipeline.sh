#!/usr/bin/env bash
# Install (scripts/setup.sh), then materialize the whole deployment with Dagster: every experiment
# of configs/experiments/ (raw_shards -> tokenizer -> token_cache -> train_ckpt -> eval_report,
# hf_export; the stages experiments share once), then experiments/comparison.
# The Dagster instance persists in .dagster_home/ (SQLite); artifacts go to artifacts/.
# One other config alone: LM_PIPELINE_EXPERIMENT=configs/tiny_llama.yaml bash scripts/run_pipeline.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DAGSTER_HOME=${DAGSTER_HOME:-$PWD/.dagster_home}
.venv/bin/python -m assets materialize
echo
echo "Done. Open the UI with:  DAGSTER_HOME=$DAGSTER_HOME .venv/bin/dagster dev   (then http://127.0.0.1:3000)"
