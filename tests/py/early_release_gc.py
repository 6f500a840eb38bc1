"""What the prefill's memory of early releases, filled to its bound, costs a full garbage
collection in a process with vLLM loaded: the old stored form against the new, in one run.

A prefill and a decode instance (tests/py/connector_flood.py's pair: vLLM's real ``Scheduler``
plus the connector's worker half each) make the process's heap what a connector's is. Then, in
cycles, the prefill's memory of early releases holds nothing, the old form, or the new form,
each filled to ``--bound`` records (production: 65,536), and ``gc.collect()`` (a full
collection) is timed ``--collections`` times per fill; the full collections that filling
triggered by themselves are counted too (CPython runs one when the objects that survived
into its oldest generation since the last grew by a quarter). The new form is filled through the
pusher's message path (one ``release`` of an unknown transfer per record); the old form is what
that path stored before (a tuple of the time and a ``_Releases`` holding a set of one rank, per
record), built directly, since no code makes it any more. Printed: the tracked objects and the
median full collection of each form over all cycles, the full collections its fills
triggered, and the ratio old / new.

    PYTHONPATH=build/dev/python python3 tests/py/early_release_gc.py [--bound 65536]
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from connector_flood import PRODUCTION_BOUND, Pair
from moriio_native.control.messages import Release
from moriio_native.pd import pusher as pusher_module
from moriio_native.pd.pusher import Pusher
from test_vllm_support import write_model_dir

logger = logging.getLogger("moriio_native.tests.early_release_gc")

FORMS = ("empty", "old", "new")


def _fill(form: str, pusher: Pusher, bound: int) -> OrderedDict[str, object]:
    """Fill the memory in ``form``; what holds the old form (kept alive by the caller)."""
    old: OrderedDict[str, object] = OrderedDict()
    for i in range(bound if form != "empty" else 0):
        tid = f"flood-{i}"
        if form == "old":
            old[tid] = (time.monotonic(), pusher_module._Releases(1, {0}))
        else:
            pusher.on_release(Release(tid))
    return old


def _timed_collections(count: int) -> list[float]:
    gc.collect()
    gc.collect()  # what a first pass leaves tracked is untracked by now
    out = []
    for _ in range(count):
        started = time.perf_counter()
        gc.collect()
        out.append(time.perf_counter() - started)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bound", type=int, default=PRODUCTION_BOUND)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--collections", type=int, default=5, help="timed per fill")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("moriio_native").setLevel(logging.WARNING)
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    tracked: dict[str, int] = {}
    triggered = dict.fromkeys(FORMS, 0)
    with tempfile.TemporaryDirectory(prefix="gc-model-") as tmp:
        pair = Pair(write_model_dir(Path(tmp)))
        try:
            pair.round([])  # the connector's first allocations
            pusher = pair.p.worker.worker.core.pusher
            saved_bound = pusher_module.MAX_EARLY_MESSAGES
            pusher_module.MAX_EARLY_MESSAGES = args.bound
            try:
                for _ in range(args.cycles):
                    for form in FORMS:
                        gc.collect()
                        full = gc.get_stats()[2]["collections"]
                        held = _fill(form, pusher, args.bound)
                        triggered[form] += gc.get_stats()[2]["collections"] - full
                        times[form] += _timed_collections(args.collections)
                        tracked[form] = len(gc.get_objects())
                        held.clear()
                        pusher._early_releases = pusher_module._EarlyReleases()
            finally:
                pusher_module.MAX_EARLY_MESSAGES = saved_bound
        finally:
            pair.shutdown()
    ms = {form: statistics.median(times[form]) * 1e3 for form in FORMS}
    # The fastest collection: the one the shared machine disturbed least.
    least = {form: min(times[form]) * 1e3 for form in FORMS}
    for form in FORMS:
        logger.warning(
            "%-5s: %d tracked objects; full collection median %.1f ms (min %.1f, max %.1f; %d); "
            "%d full collections triggered by %d fills",
            form,
            tracked[form],
            ms[form],
            least[form],
            max(times[form]) * 1e3,
            len(times[form]),
            triggered[form],
            args.cycles,
        )
    logger.warning(
        "%d early releases: old form +%d tracked objects, full collection %+.1f ms (median) / "
        "%+.1f ms (min) against none; new form +%d, %+.1f / %+.1f ms; ratio old / new %.2fx "
        "(median), %.2fx (min); full collections the fills triggered: old %d, new %d",
        args.bound,
        tracked["old"] - tracked["empty"],
        ms["old"] - ms["empty"],
        least["old"] - least["empty"],
        tracked["new"] - tracked["empty"],
        ms["new"] - ms["empty"],
        least["new"] - least["empty"],
        ms["old"] / ms["new"],
        least["old"] / least["new"],
        triggered["old"],
        triggered["new"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
