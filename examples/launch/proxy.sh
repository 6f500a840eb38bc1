#!/usr/bin/env bash
# The proxy clients talk to (docs/vllm.md, "Launch recipe"). Start it first: instances register
# with it every few seconds. vllm-router (--vllm-pd-disaggregation --kv-connector moriio
# --vllm-discovery-address 0.0.0.0:36367) speaks the same protocol and can replace it.
set -euo pipefail
PROXY_HTTP_PORT=${PROXY_HTTP_PORT:-10001}
PROXY_PING_PORT=${PROXY_PING_PORT:-36367}
exec python3 "$(dirname "$0")/proxy.py" --port "$PROXY_HTTP_PORT" --discovery-port "$PROXY_PING_PORT" "$@"
