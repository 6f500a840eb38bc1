"""The connector-level soak (tests/py/connector_soak.py), short: a few hundred READs of mixed
lengths with 64 in flight through vLLM's Scheduler and the connector's worker halves in two
processes over UCX; every invariant of the soak must hold. The full run (10,000 transfers) is
in docs/reliability.md."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

import connector_soak
from test_vllm_support import write_model_dir

pytestmark = [pytest.mark.ucx, pytest.mark.vllm]

MAX_S = 600.0  # hang guard, not a performance bound


@pytest.mark.parametrize("check", ["none", "confirm_reads", "verify"])
def test_short_connector_soak_has_no_violation(tmp_path: Path, check: str) -> None:
    """With ``confirm_reads`` or ``verify`` every READ is also checked with the prefill, 64
    outstanding at a time on one connection's thread (the checks' PolledRequests): every one
    must pass."""
    model = write_model_dir(tmp_path / "model")
    figures = connector_soak.run(
        model, transfers=300, in_flight=64, verify_every=10, max_s=MAX_S, check=check
    )
    assert figures["violations"] == [], figures
    assert figures["checked"] == (0 if check == "none" else 300), figures
    # 64 outstanding whenever requests were left to start, and the sampled ones byte-verified.
    assert figures["max_in_flight"] == 64 and figures["min_full_window"] == 64, figures
    assert figures["verified"] == 30, figures


def test_the_audit_names_each_broken_invariant() -> None:
    """The check itself: a soak whose sides lost a block, released a request twice or lost a
    request is reported, with who and what."""
    clean = {
        "reports": {"finished_sending": {"a": 1, "b": 1}, "finished_recving": {}},
        "unfinished": 0,
        "free": 10,
        "initial_free": 10,
        "nonzero_ref_counts": {},
        "pending_transfers": 0,
        "quarantined_transfers": 0,
    }
    result = {"done": 2, "verify_failures": [], "load_failures": []}
    decode = {**clean, "reports": {"finished_sending": {}}, "result": result}
    assert connector_soak.violations(2, clean, decode) == []
    broken = {
        **clean,
        "reports": {"finished_sending": {"a": 2}},
        "free": 9,
        "nonzero_ref_counts": {3: -1},
    }
    found = connector_soak.violations(2, broken, {**decode, "result": {**result, "done": 1}})
    text = "\n".join(found)
    for expected in (
        "decode: 1 of 2 requests done",
        "prefill: 1 of 2 reported finished-sending",
        "finished_sending reported more than once",
        "prefill: 1 blocks not back in the pool",
        "reference counts != 0: {3: -1}",
    ):
        assert expected in text, found
    confirmed = {"confirmed_reads": 1, "confirm_failures": 1}
    checked = {**decode, "result": {**result, "prefill_checks": confirmed}}
    found = connector_soak.violations(2, clean, checked, "confirm_reads")
    assert found == ["decode: confirm_reads: 1 of 2 READs checked, 1 failed"], found
    all_confirmed = {**decode, "result": {**result, "prefill_checks": {"confirmed_reads": 2}}}
    assert connector_soak.violations(2, clean, all_confirmed, "confirm_reads") == []
