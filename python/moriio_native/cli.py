"""The ``moriio-native`` command line.

Subcommands: ``demo`` (a verified prefill -> decode transfer on this machine), ``bench``
(planning and transfer benchmarks with baselines measured in the same run), ``backends``
(which transports can run here, and why not) and ``cmake-dir`` (for ``find_package``).
Heavy modules are imported only by the subcommand that needs them, so ``cmake-dir`` works even
where the native module cannot load.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("moriio_native.cli")

BENCH_SCHEMA = "moriio-native-bench/1"
# Largest --mib the transfer benchmark takes (1 TiB per transfer): beyond it numpy cannot even
# describe the buffers, and a setup failure must not read as "bytes disagree" (exit 1).
_MAX_BENCH_MIB = 1 << 20
# argparse's own exit status for a bad option; the demo documents 3 for every failed start.
_USAGE_ERROR = 2


def cmake_dir() -> str:
    """Directory holding moriio_nativeConfig.cmake (for CMAKE_PREFIX_PATH / moriio_native_DIR)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "cmake", "moriio_native")


def _cmd_cmake_dir(_: argparse.Namespace) -> int:
    sys.stdout.write(cmake_dir() + "\n")
    return 0


def _cmd_backends(_: argparse.Namespace) -> int:
    from moriio_native.engine import available_backends

    for info in available_backends():
        state = "available" if info.available else f"unavailable: {info.reason}"
        sys.stdout.write(f"{info.name:9s} {state}\n")
    return 0


# ---- demo -------------------------------------------------------------------------------------


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        default="minimax-m3",
        help="model preset: llama3-8b, deepseek-v3 or minimax-m3 (default: %(default)s)",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="keep only the first N transformer layers"
    )
    parser.add_argument(
        "--requests", type=int, default=16, help="requests per mode (default: %(default)s)"
    )
    parser.add_argument("--mode", choices=("read", "write", "both"), default="both")
    parser.add_argument(
        "--backend",
        choices=("auto", "ucx", "loopback"),
        default="auto",
        help="auto: UCX between two processes when it can run here, else loopback in one",
    )
    parser.add_argument(
        "--blocks-per-request", type=int, default=4, help="KV blocks per request (default 4)"
    )
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="blocks per side (default: 4x per request)"
    )
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds any single wait may take"
    )
    parser.add_argument("--seed", type=int, default=0, help="block choice and pattern seed")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="turn on the protocol's end-to-end integrity check (block checksums compared on "
        "both sides, as the connector's verify: true)",
    )
    # Hidden: flips one bit of the decode cache after the first transfer ("dst": inside a
    # destination block, "outside": in a block the request did not touch), to show that the
    # verification can fail. Used by the tests.
    parser.add_argument("--inject-fault", choices=("dst", "outside"), help=argparse.SUPPRESS)


def _cmd_demo(args: argparse.Namespace) -> int:
    from moriio_native import demo

    return demo.main(args)


# ---- bench ------------------------------------------------------------------------------------


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--planning", action="store_true", help="run the planning benchmark")
    parser.add_argument("--transfer", action="store_true", help="run the transfer benchmark")
    parser.add_argument(
        "--backend",
        choices=("auto", "ucx", "loopback"),
        default="auto",
        help="transfer backend (auto: ucx when available)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    parser.add_argument("--plot", metavar="PNG", help="write a plot (needs matplotlib)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny configuration: seconds, for smoke tests"
    )
    parser.add_argument(
        "--presets", nargs="+", default=None, help="planning presets (default: all three)"
    )
    parser.add_argument(
        "--contexts", nargs="+", type=int, default=None, help="planning context lengths (tokens)"
    )
    parser.add_argument(
        "--vllm",
        choices=("auto", "on", "off"),
        default="auto",
        help="time vLLM's MoRIIO layout code too (auto: when installed, not with --quick)",
    )
    parser.add_argument(
        "--sizes", nargs="+", type=int, default=None, help="transfer run sizes in bytes"
    )
    parser.add_argument(
        "--mib", type=int, default=None, help="MiB per transfer (default 32, --quick 1)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (median)")


def _machine() -> dict[str, Any]:
    import numpy

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            vllm_version: str | None = version("vllm")
        except PackageNotFoundError:
            vllm_version = None
    except ImportError:  # pragma: no cover
        vllm_version = None
    from moriio_native import __version__

    return {
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "vllm": vllm_version,
        "moriio_native": __version__,
    }


def run_bench(args: argparse.Namespace, console: Any = None) -> dict[str, Any]:
    """Run the benchmarks ``args`` select and return the JSON document (schema
    ``moriio-native-bench/1``): schema, date, command, machine, quick, planning (or None),
    transfer (or None)."""
    import importlib.util

    do_planning = args.planning or not args.transfer
    do_transfer = args.transfer or not args.planning
    doc: dict[str, Any] = {
        "schema": BENCH_SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "moriio-native " + shlex.join(getattr(args, "argv", ["bench"])),
        "machine": _machine(),
        "quick": bool(args.quick),
        "planning": None,
        "transfer": None,
    }
    if do_planning:
        from moriio_native.bench import planning

        presets = args.presets or list(planning.DEFAULT_PRESETS)
        contexts = args.contexts or (
            [1024, 4096] if args.quick else list(planning.DEFAULT_CONTEXTS)
        )
        have_vllm = importlib.util.find_spec("vllm") is not None
        include_vllm = args.vllm == "on" or (args.vllm == "auto" and have_vllm and not args.quick)
        if console is not None:
            console.print(
                f"planning: {', '.join(presets)} at {', '.join(str(c) for c in contexts)} tokens"
                + (" (+ vLLM baseline)" if include_vllm else "")
            )
        results = planning.run_planning_bench(
            presets,
            contexts,
            cases=() if args.quick else planning.ISSUE_CASES,
            include_vllm=include_vllm,
            min_time=0.01 if args.quick else 0.2,
            min_reps=1 if args.quick else 3,
            baseline_layers=1 if args.quick else 2,
        )
        doc["planning"] = {
            "presets": presets,
            "contexts": contexts,
            "vllm": include_vllm,
            "results": results,
        }
    if do_transfer:
        from moriio_native.bench import transfer

        sizes = args.sizes or list(
            transfer.QUICK_RUN_SIZES if args.quick else transfer.DEFAULT_RUN_SIZES
        )
        mib = args.mib if args.mib is not None else (1 if args.quick else 32)
        if not 1 <= mib <= _MAX_BENCH_MIB:
            from moriio_native.errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"--mib must be 1..{_MAX_BENCH_MIB} (MiB per transfer), got {mib}"
            )
        repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
        if console is not None:
            console.print(
                f"transfer: runs of {', '.join(str(s) for s in sizes)} bytes, "
                f"{mib} MiB per transfer, backend {args.backend}"
            )
        doc["transfer"] = transfer.run_transfer_bench(args.backend, sizes, mib << 20, repeats)
    return doc


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}x"


def _print_bench(console: Any, doc: dict[str, Any]) -> None:
    from rich.table import Table

    planning = doc.get("planning")
    if planning:
        table = Table(title="copy-plan computation per request (all layers)")
        for col in (
            "preset",
            "context",
            "blocks",
            "runs",
            "ours",
            "ns/run",
            "pure Python",
            "vLLM",
            "vs Python",
            "vs vLLM",
            "same runs",
        ):
            table.add_column(col, justify="left" if col == "preset" else "right")
        for r in planning["results"]:
            same = r["matches_python"] and r["matches_vllm"] in (True, None)
            table.add_row(
                r["preset"],
                f"{r['context_tokens'] // 1024}K",
                str(r["blocks"]),
                str(r["runs_emitted"]),
                _fmt_s(r["ours_s_per_request"]),
                f"{r['ours_ns_per_run']:.1f}",
                _fmt_s(r["python_s_per_request"]),
                _fmt_s(r["vllm_s_per_request"]),
                _fmt_x(r["speedup_vs_python"]),
                _fmt_x(r["speedup_vs_vllm"]),
                "yes" if same else "[red]NO[/red]",
            )
        console.print(table)
    transfer = doc.get("transfer")
    if transfer:
        table = Table(
            title=f"transfer GB/s, backend {transfer['backend']} ({transfer['processes']} "
            f"process{'es' if transfer['processes'] > 1 else ''}), "
            f"{transfer['bytes_per_transfer'] >> 20} MiB per transfer, median of "
            f"{transfer['repeats']}"
        )
        for col in (
            "run",
            "runs",
            "memcpy",
            "numpy gather",
            "READ",
            "WRITE",
            "READ/memcpy",
            "WRITE/memcpy",
            "verified",
        ):
            table.add_column(col, justify="right")
        for r in transfer["rows"]:
            table.add_row(
                _size_label(r["run_bytes"]),
                str(r["runs"]),
                f"{r['memcpy_gbps']:.2f}",
                f"{r['gather_gbps']:.2f}",
                f"{r['read_gbps']:.2f}",
                f"{r['write_gbps']:.2f}",
                f"{r['read_vs_memcpy']:.3f}",
                f"{r['write_vs_memcpy']:.3f}",
                "yes" if r["verified"] else "[red]NO[/red]",
            )
        console.print(table)


def _size_label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def write_plot(doc: dict[str, Any], path: str) -> None:
    """Throughput vs run size and planning time vs context length (log scales) as a PNG.
    Raises ImportError with the install hint when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib: pip install 'moriio-native[bench]' (or matplotlib)"
        ) from exc
    panels = [k for k in ("transfer", "planning") if doc.get(k)]
    if not panels:
        raise ValueError("nothing to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "transfer":
            t = doc["transfer"]
            sizes = [r["run_bytes"] for r in t["rows"]]
            for key, label, style in (
                ("memcpy_gbps", "memcpy (1 process, contiguous)", "k--"),
                ("gather_gbps", "numpy gather/scatter (1 process)", "k:"),
                ("read_gbps", f"engine READ ({t['backend']})", "o-"),
                ("write_gbps", f"engine WRITE ({t['backend']})", "s-"),
            ):
                ax.plot(sizes, [r[key] for r in t["rows"]], style, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [_size_label(n) for n in sizes])
            plain = ticker.FuncFormatter(lambda v, _pos: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
            ax.set_xlabel("run size")
            ax.set_ylabel("GB/s")
            where = "2 processes" if t["processes"] > 1 else "1 process"
            tls = f", UCX_TLS={t['ucx_tls_env']}" if t.get("ucx_tls_env") else ""
            ax.set_title(f"transfer throughput vs run size ({where}{tls})")
        else:
            p = doc["planning"]
            by_preset: dict[str, list[dict[str, Any]]] = {}
            for r in p["results"]:
                if r["preset"] in p["presets"] and r["context_tokens"] in p["contexts"]:
                    by_preset.setdefault(r["preset"], []).append(r)
            for i, (name, rows) in enumerate(sorted(by_preset.items())):
                rows.sort(key=lambda r: r["context_tokens"])
                ctx = [r["context_tokens"] for r in rows]
                color = f"C{i}"
                ax.plot(
                    ctx,
                    [r["ours_s_per_request"] for r in rows],
                    "o-",
                    color=color,
                    label=f"{name}: moriio-native",
                )
                ax.plot(
                    ctx,
                    [r["python_s_per_request"] for r in rows],
                    "--",
                    color=color,
                    label=f"{name}: pure Python",
                )
                if all(r["vllm_s_per_request"] is not None for r in rows):
                    ax.plot(
                        ctx,
                        [r["vllm_s_per_request"] for r in rows],
                        ":",
                        color=color,
                        label=f"{name}: vLLM moriio_layout",
                    )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            contexts = sorted(
                {c for rows in by_preset.values() for c in (r["context_tokens"] for r in rows)}
            )
            ax.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("seconds per request (all layers)")
            ax.set_title("copy-plan computation vs context length")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    machine = doc["machine"]
    fig.suptitle(f"{doc['date'][:10]} · {machine['cpu']} · {machine['nproc']} CPUs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib.util
    import json

    from rich.console import Console

    from moriio_native.errors import MoriioError

    console = Console(stderr=args.json)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        console.print(
            "[red]bench could not run:[/red] --plot needs matplotlib: "
            "pip install 'moriio-native[bench]' (or matplotlib)"
        )
        return 3
    if args.plot:
        target = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(target) or not os.access(target, os.W_OK):
            console.print(
                f"[red]bench could not run:[/red] --plot {args.plot}: {target} is not a "
                "writable directory"
            )
            return 3
    try:
        doc = run_bench(args, console)
    except (MoriioError, ImportError, MemoryError) as exc:
        console.print(f"[red]bench could not run:[/red] {type(exc).__name__}: {exc}")
        return 3
    if args.plot:
        try:
            write_plot(doc, args.plot)
        except (ImportError, ValueError, OSError) as exc:
            console.print(f"[red]no plot:[/red] {exc}")
            return 3
        doc["plot"] = args.plot
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        _print_bench(console, doc)
        if args.plot:
            console.print(f"plot written to {args.plot}")
    transfer = doc.get("transfer")
    bad_transfer = transfer is not None and not all(r["verified"] for r in transfer["rows"])
    planning = doc.get("planning")
    bad_plans = planning is not None and not all(
        r["matches_python"] and r["matches_vllm"] in (True, None) for r in planning["results"]
    )
    return 1 if bad_transfer or bad_plans else 0


# ---- parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moriio-native", description="KV-cache transfer for P/D disaggregated serving."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("cmake-dir", help="print the CMake package directory").set_defaults(
        func=_cmd_cmake_dir
    )
    sub.add_parser(
        "backends", help="list transport backends and why any is unavailable"
    ).set_defaults(func=_cmd_backends)
    demo = sub.add_parser(
        "demo",
        help="run a verified prefill->decode KV transfer on this machine",
        description="Start a prefill and a decode engine (two processes with UCX, two threads "
        "of one process with loopback), move the KV cache of a model preset in READ and WRITE "
        "mode through the control plane, verify every destination byte and print a summary. "
        "Exit code 0: verified; 1: a mismatch or failed transfer; 3: could not start.",
    )
    _add_demo_arguments(demo)
    demo.set_defaults(func=_cmd_demo)
    bench = sub.add_parser(
        "bench",
        help="planning and transfer benchmarks against baselines measured in the same run",
        description="Planning: per-request copy plans vs a pure-Python planner and (when "
        "installed) vLLM's MoRIIO layout code, 1K-128K tokens, three presets. Transfer: engine "
        "GB/s vs memcpy across run sizes. Without --planning/--transfer both run.",
    )
    _add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        # `demo` documents exit 3 for a demo that could not start, a bad option included.
        command = next((a for a in argv if not a.startswith("-")), None)
        if exc.code == _USAGE_ERROR and command == "demo":
            return 3
        raise
    args.argv = argv  # recorded in benchmark output as the exact command
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
