"""The decode's hold check (``confirm_reads``, :class:`moriio_native.pd.verify.ReadConfirmer`)
against handshake servers on 127.0.0.1: what it sends, what its verdicts say, that checks
waiting on a stalled prefill hold up no other prefill's however many they are, that a check
waits as long as the decode's transfer_timeout, and which ranks confirm at all."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from moriio_native.control.addressing import ZmqAddress
from moriio_native.control.channel import HandshakeServer
from moriio_native.control.messages import ChecksumRequest, ChecksumResponse, HandshakeResponse
from moriio_native.control.security import ControlSecurity, MessageAuth, PeerAllowlist
from moriio_native.errors import FailedPreconditionError
from moriio_native.pd.config import PdConfig
from moriio_native.pd.groups import GroupedBlocks
from moriio_native.pd.puller import _read_remote_ids
from moriio_native.pd.tasks import RecvTask
from moriio_native.pd.verify import CHECK_THREADS, ReadConfirmer, Verifier

LOCAL = "127.0.0.1"
WAIT_S = 10.0


def _security() -> ControlSecurity:
    return ControlSecurity(MessageAuth(None), PeerAllowlist(["127.0.0.0/8"]))


def _peer(port: int, engine_id: str = "prefill-0") -> Any:
    """What the confirmer reads of a handshaken peer: its host, handshake port and engine id."""
    return SimpleNamespace(
        host=LOCAL,
        key=SimpleNamespace(handshake_port=port),
        response=SimpleNamespace(engine_id=engine_id),
    )


def _metadata(_request: Any) -> HandshakeResponse:
    return HandshakeResponse("prefill-0", b"m", 0, 0, 1, 1, "READ")


class Verdicts:
    """Collects verdicts by name, with the time each came."""

    def __init__(self) -> None:
        self.got: dict[str, tuple[float, str | None]] = {}
        self._cond = threading.Condition()

    def for_(self, name: str) -> Any:
        def verdict(why: str | None) -> None:
            with self._cond:
                self.got[name] = (time.monotonic(), why)
                self._cond.notify_all()

        return verdict

    def wait(self, *names: str, within: float = WAIT_S) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: all(n in self.got for n in names), within), self.got


def _silent_port() -> socket.socket:
    """A TCP port that accepts connections and never answers (a stopped prefill)."""
    sock = socket.socket()
    sock.bind((LOCAL, 0))
    sock.listen(64)
    return sock


def test_a_hold_check_names_the_answer_and_passes_when_the_prefill_confirms() -> None:
    asked: list[ChecksumRequest] = []

    def answer(request: ChecksumRequest) -> ChecksumResponse:
        asked.append(request)
        return ChecksumResponse(transfer_id=request.transfer_id, checksums={})

    confirmer = ReadConfirmer(_security(), "decode-0", timeout=5.0)
    verdicts = Verdicts()
    with HandshakeServer(0, _metadata, _security(), bind_host=LOCAL, checksums=answer) as server:
        confirmer.confirm(
            "t-1", _peer(server.port), (7, 3, 9), 1234, verdicts.for_("t-1"), (9, 7, 3, 5)
        )
        verdicts.wait("t-1")
        confirmer.confirm("t-2", _peer(server.port), (7,), 1234, verdicts.for_("t-2"))
        verdicts.wait("t-2")
        kept = confirmer._requests
        assert kept.idle == 1  # both checks on one connection, kept for the next
    confirmer.shutdown()
    assert kept.idle == 0  # closed with the confirmer
    assert verdicts.got["t-1"][1] is None and verdicts.got["t-2"][1] is None
    request = asked[0]
    assert len(asked) == 2 and request.hold_only and request.transfer_id == "t-1"
    assert request.block_ids == (7, 3, 9) and request.hold_until_ms == 1234
    assert request.answer_ids == (9, 7, 3, 5)  # the answer as the READ used it, in order


def test_a_refused_hold_check_fails_naming_the_prefill_the_transfer_and_the_reason() -> None:
    def refuse(request: ChecksumRequest) -> ChecksumResponse:
        raise FailedPreconditionError(
            f"hold check of transfer {request.transfer_id}: its blocks are no longer held: released"
        )

    confirmer = ReadConfirmer(_security(), "decode-0", timeout=5.0)
    verdicts = Verdicts()
    with HandshakeServer(0, _metadata, _security(), bind_host=LOCAL, checksums=refuse) as server:
        confirmer.confirm("t-2", _peer(server.port, "p-7"), (1,), 0, verdicts.for_("t-2"))
        verdicts.wait("t-2")
    confirmer.shutdown()
    why = verdicts.got["t-2"][1]
    assert why is not None
    assert why.startswith("the prefill p-7 did not confirm the READ of transfer t-2: ")
    assert "its blocks are no longer held: released" in why


def test_its_one_thread_is_there_from_the_start() -> None:
    """Every READ is confirmed (with a secret, by default): the confirmer's thread starts with
    it, so the decode's thread count does not grow over the first rounds of load (the
    end-to-end tier's no-growth check once saw 82 threads become 85 when checks started
    threads as they came). One thread waits for every check."""

    before = set(threading.enumerate())
    confirmer = ReadConfirmer(_security(), "decode-0", timeout=5.0)
    try:
        started = set(threading.enumerate()) - before
        assert [t.name for t in started] == ["moriio-native-confirm"]
    finally:
        confirmer.shutdown()
    assert not any(t.name == "moriio-native-confirm" for t in threading.enumerate())


def test_a_server_that_answers_no_hold_checks_fails_the_check() -> None:
    confirmer = ReadConfirmer(_security(), "decode-0", timeout=5.0)
    verdicts = Verdicts()
    with HandshakeServer(0, _metadata, _security(), bind_host=LOCAL) as server:
        confirmer.confirm("t-3", _peer(server.port), (1,), 0, verdicts.for_("t-3"))
        verdicts.wait("t-3")
    confirmer.shutdown()
    why = verdicts.got["t-3"][1]
    assert why is not None and "a hold check of transfer t-3 asked" in why
    assert "confirm_reads are off here" in why


class _NoChecksums:
    """A rank with no layers: its checksums of any blocks are none (verify's compare of two
    empty sets passes)."""

    layers: tuple[str, ...] = ()

    def compute(self, block_ids: Any, window: Any = None) -> dict[str, bytes]:
        return {}


def _check(checker: Any, tid: str, port: int, verdict: Any) -> None:
    """One check of ``tid`` with the prefill at ``port``: a hold check, or verify's."""
    if isinstance(checker, ReadConfirmer):
        checker.confirm(tid, _peer(port), (1,), 0, verdict)
    else:
        checker.check_read(tid, _peer(port), (1,), (1,), verdict)


@pytest.mark.parametrize("checker", ["confirm_reads", "verify"])
def test_checks_waiting_on_a_stalled_prefill_hold_up_no_other_prefills(checker: str) -> None:
    """Checks wait on a prefill that never answers; a check to a live prefill after them still
    gets its answer at once, and the stalled ones fail at the timeout, each naming the
    transfer. However many wait: before, 8 threads each waited for one check, so the ninth
    stalled check and every check after it waited for a thread."""

    def answer(request: ChecksumRequest) -> ChecksumResponse:
        return ChecksumResponse(transfer_id=request.transfer_id, checksums={})

    timeout = 2.0
    checks: Any = (
        ReadConfirmer(_security(), "decode-0", timeout=timeout)
        if checker == "confirm_reads"
        else Verifier(_NoChecksums, _security(), "decode-0", timeout=timeout)
    )
    verdicts = Verdicts()
    stalled = [f"stalled-{i}" for i in range(3 * CHECK_THREADS)]
    with (
        HandshakeServer(0, _metadata, _security(), bind_host=LOCAL, checksums=answer) as live,
        _silent_port() as silent,
    ):
        start = time.monotonic()
        for tid in stalled:
            _check(checks, tid, silent.getsockname()[1], verdicts.for_(tid))
        _check(checks, "live", live.port, verdicts.for_("live"))
        verdicts.wait("live", *stalled)
    checks.shutdown()
    live_at, live_why = verdicts.got["live"]
    assert live_why is None and live_at - start < timeout / 2
    named = "did not confirm the READ of" if checker == "confirm_reads" else "checksums of"
    for tid in stalled:
        at, why = verdicts.got[tid]
        assert timeout * 0.9 <= at - start < timeout * 1.9
        assert why is not None and f"{named} transfer {tid}" in why
        assert f"no reply within {timeout:g}s" in why


def test_a_hold_check_waits_as_long_as_the_decodes_transfer_timeout() -> None:
    """A prefill that answers a hold check after 10.5 s (a TP-2 prefill frozen on a loaded
    host, seen in CI) is heard by a decode whose transfer_timeout is 12 s. Before, the wait was
    capped at 10 s whatever transfer_timeout said, so the READ failed and was recomputed."""

    def late(request: ChecksumRequest) -> ChecksumResponse:
        time.sleep(10.5)
        return ChecksumResponse(transfer_id=request.transfer_id, checksums={})

    confirmer = ReadConfirmer(_security(), "decode-0", timeout=12.0)
    verdicts = Verdicts()
    with HandshakeServer(0, _metadata, _security(), bind_host=LOCAL, checksums=late) as server:
        confirmer.confirm("t-late", _peer(server.port), (1,), 0, verdicts.for_("t-late"))
        verdicts.wait("t-late", within=15.0)
    confirmer.shutdown()
    assert verdicts.got["t-late"][1] is None


def test_a_check_unanswered_in_time_leaves_the_next_check_its_own_answer() -> None:
    """The first check's answer comes after its deadline: it fails then, naming the wait, and
    the late answer is dropped; the next check to that prefill gets its own answer."""
    release_first = threading.Event()

    def answer(request: ChecksumRequest) -> ChecksumResponse:
        if request.transfer_id == "slow":
            release_first.wait(WAIT_S)
        return ChecksumResponse(transfer_id=request.transfer_id, checksums={})

    confirmer = ReadConfirmer(_security(), "decode-0", timeout=0.5)
    verdicts = Verdicts()
    with HandshakeServer(0, _metadata, _security(), bind_host=LOCAL, checksums=answer) as server:
        confirmer.confirm("slow", _peer(server.port), (1,), 0, verdicts.for_("slow"))
        verdicts.wait("slow")
        release_first.set()
        confirmer.confirm("next", _peer(server.port), (1,), 0, verdicts.for_("next"))
        verdicts.wait("next")
    confirmer.shutdown()
    slow = verdicts.got["slow"][1]
    assert slow is not None and "no reply within 0.5s" in slow
    assert verdicts.got["next"][1] is None


def test_checks_waiting_when_the_confirmer_shuts_down_fail_and_later_ones_are_refused() -> None:
    confirmer = ReadConfirmer(_security(), "decode-0", timeout=30.0)
    verdicts = Verdicts()
    with _silent_port() as silent:
        port = silent.getsockname()[1]
        confirmer.confirm("waiting", _peer(port), (1,), 0, verdicts.for_("waiting"))
        confirmer.shutdown()
        verdicts.wait("waiting")
        confirmer.confirm("after", _peer(port), (1,), 0, verdicts.for_("after"))
        verdicts.wait("after")
    waiting, after = verdicts.got["waiting"][1], verdicts.got["after"][1]
    assert waiting is not None and "did not confirm the READ of transfer waiting" in waiting
    assert "closed before" in waiting  # it was sent, or not yet
    assert after is not None and "the requester is closed" in after
    assert "did not confirm the READ of transfer after" in after


def _config(**kw: Any) -> PdConfig:
    base: dict[str, Any] = {
        "engine_id": "e",
        "mode": "read",
        "producer": False,
        "consumer": True,
        "host_ip": LOCAL,
        "handshake_port": 1,
        "notify_port": 2,
    }
    return PdConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "confirms"),
    [
        ({"confirm_reads": True}, True),
        ({}, False),
        ({"confirm_reads": True, "verify": True}, False),  # the checksum request confirms
        ({"confirm_reads": True, "mode": "write"}, False),  # nothing to confirm
        ({"confirm_reads": True, "producer": True, "consumer": False}, False),  # reads nothing
    ],
)
def test_which_ranks_confirm_their_reads(kw: dict[str, Any], confirms: bool) -> None:
    assert _config(**kw).confirms_reads is confirms


@pytest.mark.parametrize(
    ("kw", "answers"),
    [
        ({"confirm_reads": True, "producer": True}, True),
        ({"confirm_reads": True, "producer": True, "consumer": False}, True),
        ({"producer": True}, False),
        ({"confirm_reads": True}, False),  # a decode-only rank holds nothing to confirm
        ({"confirm_reads": True, "producer": True, "mode": "write"}, False),
    ],
)
def test_which_ranks_answer_hold_checks(kw: dict[str, Any], answers: bool) -> None:
    assert _config(**kw).answers_hold_checks is answers


def _task(**kw: Any) -> RecvTask:
    return RecvTask("r", "t", ZmqAddress(LOCAL, 1, 2), "p", 0, 1, **kw)


def test_a_hold_check_names_every_prefill_block_the_read_takes() -> None:
    plain = _task(local_block_ids=(4, 5, 6), remote_block_ids=(9, 8, 7))
    assert _read_remote_ids(plain) == (9, 8, 7)
    grouped = GroupedBlocks(local=((1, 2), (3,)), remote=((5, 0), (6, 5)), start=0, end=32)
    assert _read_remote_ids(_task(grouped=grouped)) == (5, 6)  # sorted, no null block


class _SlowChecksums:
    """A rank whose checksums take ``seconds`` each (block 99's take ``long_s``: a long prompt)."""

    layers: tuple[str, ...] = ()

    def __init__(self, seconds: float, long_s: float = 0.0) -> None:
        self.seconds, self.long_s = seconds, long_s

    def compute(self, block_ids: Any, window: Any = None) -> dict[str, bytes]:
        time.sleep(self.long_s if 99 in block_ids else self.seconds)
        return {}


def test_verifys_verdicts_come_as_each_reads_own_checksums_are_done() -> None:
    """Four READs at once, our checksums 0.4 s each, the prefill answering at once: each
    verdict comes as soon as its own checksums are done. Before (a review found it), each
    compare queued behind every computation submitted before the answer came, so all four
    verdicts came at the end, and with them each READ's release."""
    slow = _SlowChecksums(0.4)
    checks = Verifier(lambda: slow, _security(), "decode-0", timeout=30.0)
    verdicts = Verdicts()

    def answer(request: ChecksumRequest) -> ChecksumResponse:
        return ChecksumResponse(transfer_id=request.transfer_id, checksums={})

    tids = [f"r{i}" for i in range(4)]
    with HandshakeServer(0, _metadata, _security(), bind_host=LOCAL, checksums=answer) as live:
        start = time.monotonic()
        for tid in tids:
            checks.check_read(tid, _peer(live.port), (1,), (1,), verdicts.for_(tid))
        verdicts.wait(*tids)
    checks.shutdown()
    assert all(verdicts.got[tid][1] is None for tid in tids), verdicts.got
    first, last = verdicts.got[tids[0]][0] - start, verdicts.got[tids[-1]][0] - start
    assert last >= 4 * 0.4 * 0.9
    assert first < last - 0.6, (first, last)  # not all at the end


def test_every_read_verify_checks_gets_a_verdict_when_the_verifier_shuts_down() -> None:
    """Checks waiting on a silent prefill, one of them with its own checksums still computing
    (a long prompt) and one queued behind it: the verifier shuts down, and every one gets a
    verdict (failed). Before, the checks whose compare was queued on the computing thread were
    cancelled with it and never got one."""
    slow = _SlowChecksums(0.0, long_s=2.0)
    checks = Verifier(lambda: slow, _security(), "decode-0", timeout=30.0)
    verdicts = Verdicts()
    with _silent_port() as silent:
        port = silent.getsockname()[1]
        for tid in ("w0", "w1"):
            checks.check_read(tid, _peer(port), (1,), (1,), verdicts.for_(tid))
        checks.check_read("long", _peer(port), (99,), (99,), verdicts.for_("long"))
        checks.check_read("queued", _peer(port), (1,), (1,), verdicts.for_("queued"))
        time.sleep(0.3)  # the long prompt's checksums computing, "queued" behind them
        checks.shutdown()
        verdicts.wait("w0", "w1", "long", "queued", within=WAIT_S)
    for tid in ("w0", "w1", "long", "queued"):
        why = verdicts.got[tid][1]
        assert why is not None and f"transfer {tid}" in why, (tid, why)
