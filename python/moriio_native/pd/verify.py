"""The end-to-end integrity check of one rank (``verify``): block checksums compared across a
transfer's two sides (:mod:`moriio_native.verify` computes them over logical cells).

* Decode, READ (:meth:`Verifier.check_read`): once the engine READ is done, the prefill rank is
  asked (``checksum_request`` on its handshake channel) for the checksums of the blocks it
  read, and they are compared with ours over the blocks the READ wrote. The decode's
  ``release`` goes out only after this, so the prefill's blocks cannot change in between.
* Decode, WRITE (:meth:`Verifier.check_write`): the checksums ``write_done`` carries are
  compared with ours once every write landed.
* Prefill: :meth:`Verifier.answer` serves ``checksum_request`` (READ; on the handshake server's
  answering pool) and :meth:`Verifier.for_write_done` computes what ``write_done`` carries (WRITE).

A mismatch, a missing answer or a peer that does not verify fails the load: its blocks are
recomputed, the stats count a verify failure and the log names the transfer, layer and block.

Test hook, never for production: with ``MORIIO_NATIVE_TEST_ONLY_CORRUPT_RECEIVED_KV=<n>`` in
its environment, a decode rank that verifies sets the first 8 bytes of the first received block
of its first ``n`` checked transfers to 0xFF (NaNs), after the transfer landed and before its
own checksums (as silent corruption on the way would), so a test can see the check fail the
load and the request recomputed under ``vllm serve`` (tests/e2e/test_serve_verify.py). With
``<n>:unchecked`` it sets them right after its checksums instead: the check passes and vLLM
generates from the corrupted KV (the test's control: that corruption changes the completion).
Set, it is logged as an error when the rank starts; it has no effect with ``verify`` off.

The prefill's answers to a READ's checks (verify's checksums, confirm_reads' hold checks) are
waited for by one thread per checker (``moriio-native-verify-ask``, ``moriio-native-confirm``:
:class:`~moriio_native.control.channel.PolledRequests`, one connection kept to each prefill
rank), so checks waiting on a stalled prefill hold up no other prefill's and keep no thread; a
READ's own checksums are computed on one more thread (``moriio-native-verify-local``) while the
prefill computes its, and a WRITE's on a pool of :data:`CHECK_THREADS` (``moriio-native-verify``),
never under the context lock; verdicts come back through the callback, on those threads.
Thread-safe.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from typing import Protocol

from moriio_native.control.channel import PolledRequests, ask_checksums
from moriio_native.control.messages import ChecksumRequest, ChecksumResponse
from moriio_native.control.security import ControlSecurity
from moriio_native.errors import FailedPreconditionError, MoriioError
from moriio_native.pd.peers import Peer
from moriio_native.pools import COMPUTING_EXIT_WAIT_S, DaemonPool, when_cancelled
from moriio_native.verify import WHOLE_BLOCK, CellWindow, LayerChecksums, compare

logger = logging.getLogger("moriio_native.pd.verify")

#: The test hook's variable (module docstring): how many checked transfers to corrupt.
CORRUPT_ENV = "MORIIO_NATIVE_TEST_ONLY_CORRUPT_RECEIVED_KV"

# Mismatched blocks named in one log line / failure reason (the rest are counted).
MAX_NAMED_MISMATCHES = 8
#: verify's checks of received WRITEs computed at once per rank.
CHECK_THREADS = 8
#: How long a connection to a prefill rank is kept idle for the next check (closed after by
#: the thread that waits for the checks, if no check comes).
KEPT_IDLE_S = 30.0

#: Called with None when the transfer is intact, else with why it is not.
Verdict = Callable[[str | None], None]


class Checksummer(Protocol):
    """Computes this rank's checksums (moriio_native.verify.LayerChecksums satisfies it)."""

    @property
    def layers(self) -> tuple[str, ...]: ...

    def compute(
        self, block_ids: Sequence[int], window: CellWindow = WHOLE_BLOCK
    ) -> dict[str, bytes]: ...


class Verifier:
    """The checks of one rank. ``checksummer`` is called when first needed (the caches are
    registered after the core is built)."""

    def __init__(
        self,
        checksummer: Callable[[], Checksummer],
        security: ControlSecurity,
        engine_id: str,
        *,
        timeout: float,
    ) -> None:
        self._checksummer = checksummer
        self._security = security
        self._engine_id = engine_id
        self._timeout = timeout
        # The checks of received WRITEs (our checksums of the blocks written and the compare):
        # several at once.
        self._pool = DaemonPool(
            CHECK_THREADS, "moriio-native-verify", exit_wait_s=COMPUTING_EXIT_WAIT_S
        )
        # The prefill's checksums of our READs, all waited for by one thread on one connection
        # kept to each prefill rank: a stalled prefill holds up no other prefill's checks.
        self._requests = PolledRequests(security, "moriio-native-verify-ask", idle_s=KEPT_IDLE_S)
        # Our side of a READ's check, computed while the prefill computes its own.
        self._local = DaemonPool(1, "moriio-native-verify-local", exit_wait_s=COMPUTING_EXIT_WAIT_S)
        self._corrupt_left, self._corrupt_unchecked = _corrupt_setting()
        self._corrupt_lock = threading.Lock()
        if self._corrupt_left:
            logger.error(
                "%s=%s: TEST HOOK ENABLED on %s: the first %d transfers this rank verifies get "
                "received bytes corrupted on purpose (%s); never set this outside a test",
                CORRUPT_ENV,
                os.environ[CORRUPT_ENV].strip(),
                engine_id,
                self._corrupt_left,
                "after the check: it passes and the corrupted KV is used"
                if self._corrupt_unchecked
                else "their loads fail and are recomputed",
            )

    def shutdown(self) -> None:
        """End the checks waiting for the prefill (failed), then drop the queued ones; one
        computing finishes on its own, and its verdict then meets a stopped core (its sends are
        refused, logged)."""
        self._requests.close()
        self._pool.shutdown()
        self._local.shutdown()

    # ---- decode -------------------------------------------------------------------------------

    def check_read(
        self,
        transfer_id: str,
        peer: Peer,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        verdict: Verdict,
        hold_until_ms: int = 0,
        answer_ids: Sequence[int] = (),
        answer_sizes: Sequence[int] = (),
    ) -> None:
        """Compare the prefill's checksums of ``remote_ids`` (asked from ``peer``, under the
        answer that stated ``hold_until_ms``) with ours of ``local_ids``, computed meanwhile;
        ``verdict`` gets the outcome, once, on whichever thread finished last (ours, or the one
        that waits for the prefill), also when the check is cut short at shutdown."""
        what = f"integrity check of transfer {transfer_id}"
        try:
            ours = self._local.submit(self._ours, transfer_id, local_ids)
        except RuntimeError as exc:  # shut down
            verdict(f"{what} could not run: {exc}")
            return

        def answered(outcome: ChecksumResponse | MoriioError) -> None:
            # Compared once our checksums are done: at once when they are (on the requests'
            # thread: a pass over two small dicts), else on their thread right after them; one
            # cancelled at shutdown still gets its verdict.
            def compare(done: Future[dict[str, bytes]]) -> None:
                try:
                    why = self._read_verdict(
                        transfer_id, peer, outcome, done, local_ids, remote_ids
                    )
                except Exception as exc:
                    logger.exception("%s could not run", what)
                    why = f"{what} could not run: {exc}"
                verdict(why)

            ours.add_done_callback(compare)

        request = _checksum_request(
            self._engine_id, transfer_id, remote_ids, hold_until_ms, answer_ids, answer_sizes
        )
        _ask_prefill(self._requests, peer, request, self._timeout, answered)

    def _read_verdict(
        self,
        transfer_id: str,
        peer: Peer,
        theirs: ChecksumResponse | MoriioError,
        ours: Future[dict[str, bytes]],
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
    ) -> str | None:
        """A READ's verdict from the prefill's answer and our computation (done)."""
        try:
            computed = ours.result()
        except Exception as exc:  # cancelled at shutdown, or our checksums could not be made
            if not isinstance(exc, CancelledError):
                logger.error("transfer %s: our checksums were not computed: %s", transfer_id, exc)
            return f"integrity check of transfer {transfer_id} could not run: {exc!r}"
        if isinstance(theirs, MoriioError):
            return f"no checksums from the prefill {peer.response.engine_id}: {theirs}"
        return self._compare(transfer_id, theirs.checksums, local_ids, remote_ids, computed)

    def check_write(
        self,
        transfer_id: str,
        checksums: dict[str, bytes] | None,
        local_ids: Sequence[int],
        verdict: Verdict,
    ) -> None:
        """Compare the checksums a ``write_done`` carried (the prefill's blocks, in the order
        of ours) with ours of ``local_ids``."""

        def check() -> str | None:
            if checksums is None:
                return (
                    "the prefill's write_done carries no checksums (it does not verify: set "
                    "verify the same on both instances)"
                )
            ours = self._ours(transfer_id, local_ids)
            return self._compare(transfer_id, checksums, local_ids, None, ours)

        self._run(transfer_id, check, verdict)

    def _ours(self, transfer_id: str, local_ids: Sequence[int]) -> dict[str, bytes]:
        """Our checksums of the received ``local_ids``, after the test hook's corruption."""
        summer = self._checksummer()
        with self._corrupt_lock:
            corrupt = self._corrupt_left > 0 and len(local_ids) > 0
            if corrupt:
                self._corrupt_left -= 1
        if not corrupt:
            return summer.compute(local_ids)
        if not isinstance(summer, LayerChecksums):
            raise FailedPreconditionError(
                f"{CORRUPT_ENV}: cannot corrupt through a {type(summer).__name__}"
            )
        ours = summer.compute(local_ids) if self._corrupt_unchecked else None
        where = summer.poison_first_word(local_ids[0])
        logger.error(
            "%s: transfer %s: corrupted %s%s",
            CORRUPT_ENV,
            transfer_id,
            where,
            " after its checksums" if ours is not None else "",
        )
        return summer.compute(local_ids) if ours is None else ours

    def _compare(
        self,
        transfer_id: str,
        theirs: dict[str, bytes],
        local_ids: Sequence[int],
        remote_ids: Sequence[int] | None,
        ours: dict[str, bytes],
    ) -> str | None:
        mismatches = compare(ours, theirs, local_ids, remote_ids)
        if not mismatches:
            return None
        named = "; ".join(str(m) for m in mismatches[:MAX_NAMED_MISMATCHES])
        more = len(mismatches) - MAX_NAMED_MISMATCHES
        return f"integrity check failed for transfer {transfer_id}: {named}" + (
            f" (and {more} more)" if more > 0 else ""
        )

    def _run(self, transfer_id: str, check: Callable[[], str | None], verdict: Verdict) -> None:
        _submit_check(self._pool, f"integrity check of transfer {transfer_id}", check, verdict)

    # ---- prefill ------------------------------------------------------------------------------

    def answer(self, request: ChecksumRequest) -> ChecksumResponse:
        """The checksums a decode asks for after its READ (on the handshake server's answering
        pool). Raises (-> handshake_rejected with the reason) for bad ids or windows."""
        window = CellWindow(
            request.head_begin,
            request.heads or None,
            request.token_begin,
            request.tokens or None,
        )
        try:
            checksums = self._checksummer().compute(request.block_ids, window)
        except MoriioError as exc:
            raise FailedPreconditionError(
                f"checksums of transfer {request.transfer_id}: {exc}"
            ) from None
        return ChecksumResponse(transfer_id=request.transfer_id, checksums=checksums)

    def for_write_done(
        self,
        transfer_id: str,
        local_ids: Sequence[int],
        done: Callable[[dict[str, bytes] | None, str], None],
    ) -> None:
        """Compute the checksums of our written blocks for ``write_done``; ``done`` gets them
        (or None and why they could not be computed), on the verify thread."""

        def task() -> None:
            try:
                checksums = self._checksummer().compute(local_ids)
            except Exception as exc:
                logger.exception("transfer %s: cannot compute its checksums", transfer_id)
                done(None, f"checksums not computed: {exc}")
                return
            done(checksums, "")

        try:
            queued = self._pool.submit(task)
        except RuntimeError as exc:  # the pool is shut down
            done(None, f"checksums not computed: {exc}")
            return
        when_cancelled(queued, lambda: done(None, "checksums not computed: shut down"))


class ReadConfirmer:
    """Confirms a READ with its prefill rank (``confirm_reads`` without ``verify``): a
    ``checksum_request`` with ``hold_only``, answered only while the prefill still holds the
    transfer's blocks and the READ's blocks are among those its answer named. Without it a
    READ of blocks the prefill freed (its answer handed to a second decode after the first
    released it) or of another request's blocks (an answer changed on its way) loads whatever
    they hold, unnoticed. One round trip per READ, waited for by one thread however many are
    outstanding (:class:`PolledRequests`: a stalled prefill holds up no other prefill's checks
    and keeps no thread), each check at most ``timeout`` (the decode's transfer_timeout) from
    when the READ completed, on one connection kept to each prefill rank (a check is then a
    round trip, not a new connection and, with a secret, a key exchange); thread-safe."""

    def __init__(self, security: ControlSecurity, engine_id: str, *, timeout: float) -> None:
        self._engine_id = engine_id
        self._timeout = timeout
        # Started at once: its one thread is there from the first READ on.
        self._requests = PolledRequests(security, "moriio-native-confirm", idle_s=KEPT_IDLE_S)

    def shutdown(self) -> None:
        """Close the connections; the checks still waiting fail (their verdicts meet a
        stopped core)."""
        self._requests.close()

    def confirm(
        self,
        transfer_id: str,
        peer: Peer,
        remote_ids: Sequence[int],
        hold_until_ms: int,
        verdict: Verdict,
        answer_ids: Sequence[int] = (),
        answer_sizes: Sequence[int] = (),
    ) -> None:
        """Ask ``peer`` whether it still holds ``transfer_id``'s blocks under the answer that
        stated ``hold_until_ms`` and ``remote_ids`` (the blocks the READ took) are that
        answer's; ``verdict`` gets None, or why not (on the confirmer's thread, or on this
        one when the check cannot be asked)."""
        not_confirmed = (
            f"the prefill {peer.response.engine_id} did not confirm the READ of transfer "
            f"{transfer_id}"
        )

        def answered(outcome: ChecksumResponse | MoriioError) -> None:
            verdict(f"{not_confirmed}: {outcome}" if isinstance(outcome, MoriioError) else None)

        request = _checksum_request(
            self._engine_id, transfer_id, remote_ids, hold_until_ms, answer_ids, answer_sizes
        )
        _ask_prefill(self._requests, peer, request.replace(hold_only=True), self._timeout, answered)


def _checksum_request(
    engine_id: str,
    transfer_id: str,
    remote_ids: Sequence[int],
    hold_until_ms: int,
    answer_ids: Sequence[int],
    answer_sizes: Sequence[int] = (),
) -> ChecksumRequest:
    """A decode's request about the prefill blocks ``remote_ids`` its READ of ``transfer_id``
    took, under the answer that stated ``hold_until_ms`` and named ``answer_ids`` (in order)."""
    return ChecksumRequest(
        requester_engine_id=engine_id,
        transfer_id=transfer_id,
        block_ids=tuple(int(b) for b in remote_ids),
        hold_until_ms=hold_until_ms,
        answer_ids=tuple(int(b) for b in answer_ids),
        answer_sizes=tuple(int(n) for n in answer_sizes),
    )


def _ask_prefill(
    requests: PolledRequests,
    peer: Peer,
    request: ChecksumRequest,
    timeout: float,
    answered: Callable[[ChecksumResponse | MoriioError], None],
) -> None:
    """``request`` to ``peer``'s handshake port, waited for by ``requests``' thread;
    ``answered`` gets the answer or the error (on this thread when it cannot be asked)."""
    try:
        ask_checksums(
            requests, peer.host, peer.key.handshake_port, request, timeout=timeout, done=answered
        )
    except MoriioError as exc:
        answered(exc)


def _submit_check(
    pool: DaemonPool, what: str, check: Callable[[], str | None], verdict: Verdict
) -> None:
    """Run ``check`` on ``pool`` and hand its outcome to ``verdict``; a check that cannot run
    fails the load, never passes it."""

    def task() -> None:
        try:
            outcome = check()
        except Exception as exc:
            logger.exception("%s could not run", what)
            outcome = f"{what} could not run: {exc}"
        verdict(outcome)

    try:
        queued = pool.submit(task)
    except RuntimeError as exc:  # the pool is shut down
        verdict(f"{what} could not run: {exc}")
        return
    when_cancelled(queued, lambda: verdict(f"{what} could not run: shut down"))


def _corrupt_setting() -> tuple[int, bool]:
    """The test hook's ``(count, unchecked)`` from ``CORRUPT_ENV`` (``<n>`` or
    ``<n>:unchecked``); ``(0, False)`` when unset."""
    value = os.environ.get(CORRUPT_ENV, "").strip()
    if not value:
        return 0, False
    count, _, mode = value.partition(":")
    if not count.isdigit() or mode not in ("", "unchecked"):
        raise ValueError(
            f"{CORRUPT_ENV} must be a count of transfers (>= 0), optionally followed by "
            f"':unchecked', got {value!r}"
        )
    return int(count), mode == "unchecked"


def whole_blocks_only(transfer: str) -> str:
    """Why a ``transfer`` ("READ" or "WRITE") cannot be verified: the check compares whole
    blocks of one KV-cache group, and this one moved windows or several groups."""
    return (
        f"verify compares whole blocks of one KV-cache group; this {transfer} moved windows or "
        "several groups (different TP or block sizes, a hybrid model): turn verify off for "
        "this pair"
    )


__all__ = [
    "CHECK_THREADS",
    "CORRUPT_ENV",
    "MAX_NAMED_MISMATCHES",
    "Checksummer",
    "ReadConfirmer",
    "Verdict",
    "Verifier",
    "whole_blocks_only",
]
