"""bench/listener_threads_bench.py, one small trial of each arrangement: the baseline reads each
listener on a thread of its own, the default all on one, and every flood message is handled."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# On sys.path (not loaded from its file) so that the spawned sender can import it too.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import listener_threads_bench as bench


@pytest.mark.parametrize(("own_threads", "reader_threads"), [(True, 3), (False, 1)])
def test_a_trial_reads_every_flood_message_on_the_arrangements_threads(
    own_threads: bool, reader_threads: int
) -> None:
    trial = bench.run_trial(3, own_threads, messages=2_000, rate=4_000.0)
    assert trial.messages == 2_000
    assert trial.reader_threads == reader_threads
    assert trial.arrangement == (bench.OWN_THREADS if own_threads else bench.ONE_THREAD)
