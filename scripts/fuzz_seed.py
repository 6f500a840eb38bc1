"""Writes seed inputs for the libFuzzer targets (tests/fuzz): the peer metadata of a registered
engine, one file per cache layout. Usage: python3 scripts/fuzz_seed.py CORPUS_DIR"""

from __future__ import annotations

import sys
from pathlib import Path

import moriio_native as mn
from moriio_native import kvcache as kc

LAYOUTS = {
    "kv-separated": [
        kc.LayerShape("dense.0", "separated_nhd", block_size=4, head_size=8, num_heads=2)
    ],
    "kv-two-layers": [
        kc.LayerShape(f"dense.{i}", "separated_nhd", block_size=16, head_size=64, num_heads=4)
        for i in range(2)
    ],
}


def main(corpus: str) -> None:
    out = Path(corpus)
    out.mkdir(parents=True, exist_ok=True)
    for name, shapes in LAYOUTS.items():
        engine = mn.Engine(f"seed-{name}")
        metadata = engine.register_kv_caches(kc.build_caches(shapes, 8).registrations())
        (out / f"seed-{name}").write_bytes(metadata)


if __name__ == "__main__":
    main(sys.argv[1])
