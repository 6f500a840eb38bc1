"""Found by a review of the WRITE decode side (2026-12-07; failed before its fix), through vLLM's
real schedulers (test_vllm_lifecycle's two-instance
harness): a WRITE-mode decode request reusing the transfer id of a request this decode loaded
already is told its prefill's answer (or refused) at once, not after its deadlines."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from test_vllm_lifecycle import make_pair, model_dir, prompt_of, sides  # noqa: F401
from test_vllm_support import Side, decode_params, pd_request_id, prefill_params, transfer_id

pytestmark = pytest.mark.vllm


def test_a_write_decode_request_reusing_an_ended_transfer_id_fails_at_once(
    sides: list[Side],  # noqa: F811
    model_dir: str,  # noqa: F811
) -> None:
    """R1 (transfer T) is written into decode d and ends; R2 reuses T (a client's retry with its
    own params) on the same decode, its prefill request too. The prefill answers R2's
    announcement write_failed at once (R1's job of T ended: "transfer ids must be fresh per
    request"), and d must recompute R2 now. Before: d's notify listener dropped that
    write_failed as late (T was marked terminal when R1's load ended), R2 waited the decode's
    abort_timeout, was quarantined, the prefill's write_aborted was dropped too, and R2 stayed
    in WAITING_FOR_REMOTE_KVS until quarantine_timeout."""
    p, d = make_pair(
        sides, model_dir, "write", d_extra={"abort_timeout": 6.0, "quarantine_timeout": 60.0}
    )
    tid = transfer_id()
    prompt = prompt_of(45, seed=3)
    rid = pd_request_id(p, d)
    d.add_request(rid, prompt, params=decode_params(tid), max_tokens=2)
    d.step()
    p.add_request(rid, prompt, params=prefill_params(tid), max_tokens=1)
    p.run_until(lambda r: rid in r.transfer.finished_sending, what="R1 written")
    d.run_until(lambda r: rid in r.finished(), what="R1 to finish on the decode")

    rid2 = pd_request_id(p, d)
    other = prompt_of(45, seed=4)
    d.add_request(rid2, other, params=decode_params(tid), max_tokens=2)
    failed = rid2 in d.step().transfer.failed_recving
    p.add_request(rid2, other, params=prefill_params(tid), max_tokens=1)
    p.run_until(lambda r: rid2 in r.finished(), what="R2's prefill request")
    if not failed:
        # Well inside the decode's abort_timeout (6 s): the prefill's answer came at once.
        d.run_until(
            lambda r: rid2 in r.transfer.failed_recving,
            max_wait=4.0,
            what="R2's load to fail on the prefill's write_failed",
        )
    # Recomputed locally: it runs its whole prompt and finishes.
    d.run_until(lambda r: rid2 in r.finished(), max_wait=10.0, what="R2 to finish")
