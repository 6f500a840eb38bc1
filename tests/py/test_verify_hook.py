"""The integrity check's test hook (``MORIIO_NATIVE_TEST_ONLY_CORRUPT_RECEIVED_KV``,
moriio_native.pd.verify), which tests/e2e/test_serve_verify.py uses under ``vllm serve``: it
corrupts exactly the first ``n`` checked transfers of a rank, in a byte the checksum covers,
says so at start-up, refuses a bad value, and does nothing when unset."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from moriio_native import CacheSpec
from moriio_native.control.security import ControlSecurity, MessageAuth, PeerAllowlist
from moriio_native.engine import LayerRegistration
from moriio_native.errors import OutOfRangeError
from moriio_native.pd.verify import CORRUPT_ENV, Verifier
from moriio_native.verify import LayerChecksums

torch = pytest.importorskip("torch")

N, B, H, D = 4, 4, 2, 8  # blocks, tokens per block, heads, head size (fp32)


def layer(memory: str = "host", padded: bool = False) -> tuple[Any, LayerChecksums]:
    """One random K/V layer ([2, N, B, H, D] fp32; padded: each block slot 2 tokens longer)
    and its checksums (host: the native path; otherwise torch on the tensor)."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn((2, N, B + 2 if padded else B, H, D), generator=gen)
    tensor = full[:, :, :B] if padded else full
    spec = CacheSpec(kind="kv", block_size=B, num_kv_heads=H, head_size=D, dtype_bytes=4)
    array = full.numpy()
    reg = LayerRegistration(
        "L0",
        tensor if memory != "host" else tensor.numpy(),
        spec,
        allocation=(array.ctypes.data, array.nbytes),
        memory=memory,
        device=0 if memory != "host" else -1,
    )
    return tensor, LayerChecksums.for_registrations([reg])


@pytest.mark.parametrize(
    ("memory", "padded"), [("host", False), ("host", True), ("cuda", False)], ids=str
)
def test_poison_first_word_changes_that_block_only(memory: str, padded: bool) -> None:
    tensor, sums = layer(memory, padded)
    before = tensor.clone()
    ids = list(range(N))
    values = sums.compute(ids)["L0"]
    where = sums.poison_first_word(2)
    assert where.startswith("layer 'L0' block 2 bytes ")
    after = sums.compute(ids)["L0"]
    changed = [b for b in ids if after[8 * b : 8 * b + 8] != values[8 * b : 8 * b + 8]]
    assert changed == [2]
    # NaNs (what a model reading that KV would see), in block 2 only.
    nan = torch.isnan(tensor)
    assert nan.sum() == 2 and set(nan.nonzero()[:, 1].tolist()) == {2}
    assert torch.equal(tensor[~nan], before[~nan])
    with pytest.raises(OutOfRangeError, match="layer 'L0': block id 4"):
        sums.poison_first_word(N)


def verifier(sums: LayerChecksums) -> Verifier:
    security = ControlSecurity(MessageAuth(None), PeerAllowlist([]))
    return Verifier(lambda: sums, security, "d/dp0/tp0", timeout=5.0)


def check_write(v: Verifier, theirs: dict[str, bytes], block: int) -> str | None:
    """One WRITE check of ``block`` against the prefill's ``theirs``; its verdict."""
    got: list[str | None] = []
    done = threading.Event()

    def verdict(why: str | None) -> None:
        got.append(why)
        done.set()

    v.check_write(f"t{block}", theirs, [block], verdict)
    assert done.wait(30)
    return got[0]


def test_the_first_n_checks_are_corrupted_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(CORRUPT_ENV, "2")
    _, sums = layer()
    intact = {b: sums.compute([b]) for b in range(N)}
    with caplog.at_level(logging.ERROR, logger="moriio_native.pd.verify"):
        v = verifier(sums)
        try:
            assert f"{CORRUPT_ENV}=2: TEST HOOK ENABLED on d/dp0/tp0" in caplog.text
            verdicts = [check_write(v, intact[b], b) for b in range(N)]
        finally:
            v.shutdown()
    assert [why is None for why in verdicts] == [False, False, True, True]
    for block, why in zip((0, 1), verdicts, strict=False):
        assert why is not None and f"integrity check failed for transfer t{block}" in why
        assert f"transfer t{block}: corrupted layer 'L0' block {block} bytes" in caplog.text


def test_unset_corrupts_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(CORRUPT_ENV, raising=False)
    _, sums = layer()
    intact = sums.compute([0])
    with caplog.at_level(logging.DEBUG, logger="moriio_native.pd.verify"):
        v = verifier(sums)
        try:
            assert check_write(v, intact, 0) is None
        finally:
            v.shutdown()
    assert CORRUPT_ENV not in caplog.text


def test_unchecked_corrupts_after_the_check(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The control mode: the check passes, and the block the load hands to vLLM is corrupted."""
    monkeypatch.setenv(CORRUPT_ENV, "1:unchecked")
    tensor, sums = layer()
    before = tensor.clone()
    intact = sums.compute([1])
    with caplog.at_level(logging.ERROR, logger="moriio_native.pd.verify"):
        v = verifier(sums)
        try:
            assert f"{CORRUPT_ENV}=1:unchecked: TEST HOOK ENABLED" in caplog.text
            assert check_write(v, intact, 1) is None
        finally:
            v.shutdown()
    assert (
        "corrupted layer 'L0' block 1 bytes" in caplog.text and "after its checksums" in caplog.text
    )
    assert sums.compute([1]) != intact
    changed = (tensor != before).nonzero()
    assert changed.numel() > 0 and set(changed[:, 1].tolist()) == {1}


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "1:later", ":unchecked"])
def test_a_bad_count_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(CORRUPT_ENV, value)
    _, sums = layer()
    with pytest.raises(ValueError, match=f"{CORRUPT_ENV} must be a count"):
        verifier(sums)
