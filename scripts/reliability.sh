#!/usr/bin/env bash
# The full reliability tier (docs/reliability.md): every fault scenario over many rounds, then
# the soak; prints the table rows and the soak figures. The short tier of the same tests runs
# in the default pytest (tests/py). Needs a build with the UCX backend and vllm==0.33.0; the
# namespace scenarios need root. With E2E_VENV set (the end-to-end tier's environment, with
# this tree's wheel installed: tests/e2e/make_venv.sh), the vllm serve tier's fault scenarios
# (tests/e2e/test_serve_faults.py, READ and WRITE at TP 1 and TP 2) run too, the same number of
# rounds, and the integrity check under vllm serve (tests/e2e/test_serve_verify.py).
#
#   PYTHONPATH=build/dev/python [E2E_VENV=...] scripts/reliability.sh [rounds] [soak transfers]
set -euo pipefail
ROUNDS=${1:-5}
TRANSFERS=${2:-10000}
OUT=${OUT:-$(mktemp -d /tmp/moriio-reliability.XXXXXX)}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

MORIIO_FAULT_TIER=full MORIIO_FAULT_ROUNDS=$ROUNDS MORIIO_FAULT_REPORT="$OUT/faults.jsonl" \
  python3 -m pytest tests/py/test_faults_read.py tests/py/test_faults_write.py \
  tests/py/test_faults_netns.py -q -p no:cacheprovider -o addopts="" || status=$?
if [ -n "${E2E_VENV:-}" ]; then
  MORIIO_E2E_FAULT_ROUNDS=$ROUNDS MORIIO_FAULT_REPORT="$OUT/faults.jsonl" MORIIO_E2E_VERIFY=1 \
    MORIIO_E2E_WORKDIR="$OUT/e2e" timeout -k 60 7200 "$E2E_VENV/bin/python" -m pytest \
    tests/e2e/test_serve_faults.py tests/e2e/test_serve_verify.py -q -p no:cacheprovider \
    -o addopts="" \
    -o testpaths=tests/e2e || status=$?
fi
python3 scripts/reliability_table.py "$OUT/faults.jsonl"
python3 -m moriio_native.bench.soak --transfers "$TRANSFERS" --in-flight 64 --ucx-tls tcp \
  --json "$OUT/soak.json" | tail -1
# The same number of transfers through the connector (vLLM's Scheduler + worker halves).
python3 tests/py/connector_soak.py --transfers "$TRANSFERS" --in-flight 64 \
  --json "$OUT/soak-connector.json" | tail -1 || status=$?
echo "results in $OUT"
exit "${status:-0}"
