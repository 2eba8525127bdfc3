#!/usr/bin/env bash
# Run a command beside N busy CPU hogs (default 2), to check that tests hold up on a loaded
# machine:   bash scripts/with_cpu_hogs.sh 2 bash scripts/test.sh
# The hogs are killed when the command ends, however it ends; its exit code is returned.
set -uo pipefail
n=${1:?usage: with_cpu_hogs.sh N COMMAND...}
shift
pids=()
cleanup() { [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null; }
trap cleanup EXIT INT TERM
for _ in $(seq "$n"); do
  (while :; do :; done) &
  pids+=($!)
done
echo "with_cpu_hogs: $n busy loops running (pids ${pids[*]})" >&2
"$@"
