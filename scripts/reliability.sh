#!/usr/bin/env bash
# The full reliability tier (docs/reliability.md): every fault scenario over many rounds, then
# the soak; prints the table rows and the soak figures. The short tier of the same tests runs
# in the default pytest (tests/py). Needs a build with the UCX backend and vllm==0.33.0; the
# namespace scenarios need root.
#
#   PYTHONPATH=build/dev/python scripts/reliability.sh [rounds] [soak transfers]
set -euo pipefail
ROUNDS=${1:-5}
TRANSFERS=${2:-10000}
OUT=${OUT:-$(mktemp -d /tmp/moriio-reliability.XXXXXX)}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

MORIIO_FAULT_TIER=full MORIIO_FAULT_ROUNDS=$ROUNDS MORIIO_FAULT_REPORT="$OUT/faults.jsonl" \
  python3 -m pytest tests/py/test_faults_read.py tests/py/test_faults_write.py \
  tests/py/test_faults_netns.py -q -p no:cacheprovider -o addopts="" || status=$?
python3 scripts/reliability_table.py "$OUT/faults.jsonl"
python3 -m moriio_native.bench.soak --transfers "$TRANSFERS" --in-flight 64 --ucx-tls tcp \
  --json "$OUT/soak.json" | tail -1
echo "results in $OUT"
exit "${status:-0}"
