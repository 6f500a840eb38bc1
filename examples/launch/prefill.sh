#!/usr/bin/env bash
# The prefill instance of a 1P1D pair (docs/vllm.md, "Launch recipe").
#   GPUs: CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES as usual, e.g. 0..TP-1.
set -euo pipefail
source "$(dirname "$0")/common.sh"
PREFILL_PORT=${PREFILL_PORT:-20005}
PREFILL_HANDSHAKE_PORT=${PREFILL_HANDSHAKE_PORT:-6301}
PREFILL_NOTIFY_PORT=${PREFILL_NOTIFY_PORT:-61005}
# shellcheck disable=SC2086  # VLLM may be a command with arguments
exec $VLLM serve "$MODEL" --port "$PREFILL_PORT" --tensor-parallel-size "$TP" \
  --kv-transfer-config "$(kv_transfer_config kv_producer "$PREFILL_PORT" "$PREFILL_HANDSHAKE_PORT" "$PREFILL_NOTIFY_PORT")" \
  "$@"
