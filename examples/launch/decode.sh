#!/usr/bin/env bash
# The decode instance of a 1P1D pair (docs/vllm.md, "Launch recipe").
#   On the same host as the prefill, give it other GPUs and other ports (the defaults differ).
set -euo pipefail
source "$(dirname "$0")/common.sh"
DECODE_PORT=${DECODE_PORT:-40005}
DECODE_HANDSHAKE_PORT=${DECODE_HANDSHAKE_PORT:-7301}
DECODE_NOTIFY_PORT=${DECODE_NOTIFY_PORT:-7501}
# shellcheck disable=SC2086  # VLLM may be a command with arguments
exec $VLLM serve "$MODEL" --port "$DECODE_PORT" --tensor-parallel-size "$TP" \
  --kv-transfer-config "$(kv_transfer_config kv_consumer "$DECODE_PORT" "$DECODE_HANDSHAKE_PORT" "$DECODE_NOTIFY_PORT")" \
  "$@"
