"""What the end-to-end integrity check (``verify``) costs: the demo with it off and on.

Each round runs ``moriio-native demo`` (the protocol core the connector runs, prefill and decode
as two processes over UCX, or threads over loopback) once with ``verify`` off and once with it
on, same preset, seed and requests, alternating which goes first; the request latency
(decode: load started -> load reported, so it includes the checksum round trip in READ and the
prefill's checksums in WRITE) is compared per mode as p50 ratios, on / off. Beside it, the bare
checksum over the demo's caches (native core, host memory) against a plain copy of the same
bytes in this process (``numpy.copyto``: the memory-bandwidth baseline), as GB/s and a ratio.

    PYTHONPATH=build/dev/python python3 bench/verify_bench.py --preset llama3-8b \
        --blocks-per-request 64 --requests 16 --rounds 3
    PYTHONPATH=<build>/python python3 bench/verify_bench.py --device-only --blocks-per-request 2048

(``--device-only``: the checksums on a GPU, torch and the CUDA copy plugin's kernel, against a
device copy, no demo; ``--plugin PATH`` measures another build of the plugin instead of the one
beside the package.)

Prints a table (or ``--json``). Blocks until done; every demo wait is bounded by its timeout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from moriio_native import kvcache as kc
from moriio_native.demo import DemoConfig, run_demo
from moriio_native.presets import get_preset
from moriio_native.verify import LayerChecksums


def demo_round(args: argparse.Namespace, verify: bool, seed: int) -> dict[str, Any]:
    cfg = DemoConfig(
        preset=args.preset,
        requests=args.requests,
        backend=args.backend,
        blocks_per_request=args.blocks_per_request,
        seed=seed,
        verify=verify,
    )
    result = run_demo(cfg)
    if not result.ok:
        raise SystemExit(f"demo (verify={verify}) failed: {result.errors} {result.to_dict()}")
    modes = result.modes.items()
    plural = "es" if result.processes > 1 else ""
    return {name: stats.latencies_s for name, stats in modes} | {
        "_bytes": {name: stats.bytes / max(stats.requests, 1) for name, stats in modes},
        "_backend": f"{result.backend} ({result.processes} process{plural})",
    }


def checksum_throughput(args: argparse.Namespace) -> dict[str, float]:
    """GB/s of the native checksum over every cache of ``blocks_per_request`` blocks, and of a
    copy of the same number of bytes; medians of ``repeats``."""
    shapes = get_preset(args.preset).shapes(None)
    blocks = args.blocks_per_request
    cache = kc.build_caches(shapes, 2 * blocks)
    cache.backing[:] = np.random.default_rng(0).integers(0, 256, cache.backing.size, np.uint8)
    sums = LayerChecksums.for_registrations(cache.registrations())
    ids = list(range(0, 2 * blocks, 2))
    nbytes = blocks * cache.total_block_bytes()
    src = np.random.default_rng(1).integers(0, 256, nbytes, np.uint8)
    dst = np.empty_like(src)
    checksum_s, copy_s = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        sums.compute(ids)
        checksum_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        np.copyto(dst, src)
        copy_s.append(time.perf_counter() - start)
    checksum = nbytes / statistics.median(checksum_s) / 1e9
    copy = nbytes / statistics.median(copy_s) / 1e9
    return {"bytes": nbytes, "checksum_gbps": checksum, "copy_gbps": copy, "ratio": checksum / copy}


def device_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """GB/s of the checksums on a GPU over ``blocks_per_request`` blocks of layers shaped as
    vLLM's [2, N, B, H, D] bf16 (block 16, 8 KV heads, head size 128), against a device copy of
    the same bytes (``Tensor.copy_``) in this process; medians of ``repeats`` (after a warm-up).
    Torch over one layer; the CUDA copy plugin's kernel over one layer and over ``layers``
    layers in one call, described per call and described once (as ``LayerChecksums`` calls
    it), its values checked against torch's."""
    import torch

    from moriio_native import CacheSpec, describe_layer
    from moriio_native.cudacopy import Plugin, shared_plugin
    from moriio_native.verify import (
        WHOLE_BLOCK,
        checksum_cuda,
        checksum_described,
        checksum_torch,
        describe_cuda,
    )

    blocks = args.blocks_per_request
    spec = CacheSpec(kind="kv", block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2)
    caches = [
        torch.randint(
            -(2**15), 2**15, (2, 2 * blocks, 16, 8, 128), dtype=torch.int16, device="cuda"
        ).view(torch.bfloat16)
        for _ in range(args.layers)
    ]
    pairs = [(describe_layer(f"L{i}", c, spec), c) for i, c in enumerate(caches)]
    layout, cache = pairs[0]
    ids = list(range(0, 2 * blocks, 2))
    nbytes = blocks * layout.block_bytes
    src = torch.empty(nbytes * args.layers, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def timed(fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    copy = nbytes / timed(lambda: dst[:nbytes].copy_(src[:nbytes])) / 1e9
    copy_all = nbytes * args.layers / timed(lambda: dst.copy_(src)) / 1e9
    by_torch = nbytes / timed(lambda: checksum_torch(layout, cache, ids)) / 1e9
    got: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "bytes": nbytes,
        "layers": args.layers,
        "copy_gbps": copy,
        "copy_all_gbps": copy_all,
        "torch_gbps": by_torch,
        "torch_ratio": by_torch / copy,
    }
    plugin = Plugin(args.plugin) if args.plugin else shared_plugin()
    if plugin is None:
        return got
    got["plugin"] = args.plugin or "beside the package"
    for layout, cache in pairs:
        want = checksum_torch(layout, cache, ids)
        if not np.array_equal(checksum_cuda(plugin, [(layout, cache)], ids)[0], want):
            raise AssertionError(f"layer {layout.name}: the plugin's checksums differ from torch's")
    id_array = np.asarray(ids, dtype=np.int64)  # as LayerChecksums passes them
    one = nbytes / timed(lambda: checksum_cuda(plugin, pairs[:1], id_array)) / 1e9
    every = nbytes * args.layers / timed(lambda: checksum_cuda(plugin, pairs, id_array)) / 1e9
    described = describe_cuda(pairs, WHOLE_BLOCK)
    if not all(
        np.array_equal(a, b)
        for a, b in zip(
            checksum_described(plugin, described, id_array),
            checksum_cuda(plugin, pairs, id_array),
            strict=True,
        )
    ):
        raise AssertionError("the checksums of layers described once differ from per call")
    kept = timed(lambda: checksum_described(plugin, described, id_array))
    got.update(
        plugin_gbps=one,
        plugin_ratio=one / copy,
        plugin_all_gbps=every,
        plugin_all_ratio=every / copy_all,
        plugin_described_gbps=nbytes * args.layers / kept / 1e9,
        plugin_described_ratio=nbytes * args.layers / kept / 1e9 / copy_all,
    )
    return got


def describe_device(got: dict[str, Any]) -> str:
    """The --device-only result as lines of text."""
    mib = got["bytes"] / 2**20
    lines = [
        f"{got['device']}: one layer, {mib:.1f} MiB: device copy {got['copy_gbps']:.1f} GB/s; "
        f"torch checksum {got['torch_gbps']:.1f} GB/s ({got['torch_ratio']:.3f}x)"
    ]
    if "plugin_gbps" in got:
        lines.append(
            f"plugin kernel, one layer: {got['plugin_gbps']:.1f} GB/s "
            f"({got['plugin_ratio']:.3f}x); {got['layers']} layers in one call "
            f"({got['layers'] * mib:.0f} MiB): {got['plugin_all_gbps']:.1f} GB/s against a copy "
            f"of {got['copy_all_gbps']:.1f} GB/s ({got['plugin_all_ratio']:.3f}x), described "
            f"once: {got['plugin_described_gbps']:.1f} GB/s "
            f"({got['plugin_described_ratio']:.3f}x); values equal torch's; plugin "
            f"{got['plugin']}"
        )
    else:
        lines.append("CUDA copy plugin not loaded: no kernel figures")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--backend", choices=("auto", "ucx", "loopback"), default="auto")
    parser.add_argument("--blocks-per-request", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9, help="checksum timing repeats")
    parser.add_argument(
        "--layers", type=int, default=32, help="--device-only: layers in the plugin's one call"
    )
    parser.add_argument(
        "--plugin",
        default="",
        help="--device-only: a CUDA copy plugin's path (default: beside the package)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--device-only",
        action="store_true",
        help="only the checksums on the GPU (torch, the plugin) against a device copy (no demo)",
    )
    args = parser.parse_args()
    if args.device_only:
        got = device_throughput(args)
        print(json.dumps(got, indent=2) if args.json else describe_device(got))
        return 0

    latencies: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    info: dict[str, Any] = {}
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for verify in order:
            got = demo_round(args, verify, seed=r)
            info = {"bytes": got.pop("_bytes"), "backend": got.pop("_backend")}
            for mode, values in got.items():
                latencies[verify].setdefault(mode, []).extend(values)
    rows = []
    for mode in latencies[False]:
        off = statistics.median(latencies[False][mode]) * 1e3
        on = statistics.median(latencies[True][mode]) * 1e3
        rows.append(
            {
                "mode": mode.upper(),
                "requests": len(latencies[True][mode]),
                "bytes_per_request": info["bytes"][mode],
                "p50_off_ms": off,
                "p50_on_ms": on,
                "ratio": on / off,
            }
        )
    bare = checksum_throughput(args)
    out = {"preset": args.preset, "backend": info["backend"], "modes": rows, "checksum": bare}
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    print(f"preset {args.preset}, {info['backend']}, {args.blocks_per_request} blocks/request")
    print("| mode | requests | MiB / request | p50 off ms | p50 on ms | on / off |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['mode']} | {row['requests']} | {row['bytes_per_request'] / 2**20:.1f} | "
            f"{row['p50_off_ms']:.2f} | {row['p50_on_ms']:.2f} | {row['ratio']:.2f}x |"
        )
    print(
        f"checksum (native, host) {bare['checksum_gbps']:.2f} GB/s over "
        f"{bare['bytes'] / 2**20:.1f} MiB; copy {bare['copy_gbps']:.2f} GB/s; "
        f"ratio {bare['ratio']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
