"""The scheduler-side half of MoRIIONativeConnector (runs in vLLM's scheduler process).

It decides, per request, what the workers must move and when vLLM may free blocks; it never
touches the network. Flows (P = prefill instance, D = decode instance):

Block ids are vLLM's, one list per KV-cache group (:class:`~moriio_native.vllm.hybrid.
HybridLayout`: full attention, sliding window, Mamba state), positional from the request's
first token; the workers pair them with the peer's groups and block sizes once its handshake
told them (:mod:`moriio_native.pd.groups`).

READ (D pulls; asynchronously by default, the request waiting in WAITING_FOR_REMOTE_KVS)
  D ``get_num_new_matched_tokens`` -> ``(covered - computed, True)`` (``False`` with
  ``read_loading: sync``: loaded before the forward that needs it) with ``covered`` the
  prompt minus its last token. ``update_state_after_alloc`` hands the workers D's per-group
  blocks, P's advertised per-group blocks and the token range to load (from the end of D's
  own prefix cache hits: local ids are never replaced by remote ids). P's
  ``request_finished`` keeps P's blocks (``delay_free``) and returns the ``kv_transfer_params``
  D needs (one block list per group); they are freed when D's release arrives (or after
  ``abort_timeout``).

WRITE (P pushes each layer into D's blocks; D waits asynchronously)
  D ``get_num_new_matched_tokens`` -> ``(covered - computed, True)``; after allocation D's
  worker announces its per-group blocks to P, with the null block where D already holds the
  tokens, and the number of tokens it needs. P's scheduler hands its per-group blocks to its
  workers in the step that computes the last prompt chunk, and keeps them after the request
  finishes until its workers report the writes done (or failed, or ``abort_timeout`` passed).

With a sliding-window or Mamba group, P computes all but the prompt's last token and D loads
exactly those (see :mod:`moriio_native.vllm.hybrid`).

Signed answers: with ``auth_secret`` set, P tags its answer (``remote_answer_tag``) and D acts
only on an answer whose tag matches. The answer reaches D through the proxy, on the same HTTP
path as any client's request, so without the check anyone who can send D a request could name
block ids and a transfer id of their choosing: D would read another request's KV, or release its
blocks. A request with an answer that does not match runs without KV transfer, as one with
invalid params does.

Prefix hits: a full hit (nothing to load) becomes a notify-only task that makes P release.
Aborts: a D request that ends before it was scheduled also sends P a release; a P request
aborted while its writes are in flight is aborted in the engine and freed once reported.

Thread-safety: vLLM calls every method from its scheduler thread; no locking here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from moriio_native.control.addressing import (
    KEY_DO_REMOTE_DECODE,
    KEY_DO_REMOTE_PREFILL,
    KEY_LEGACY_TP_SIZE,
    KEY_REMOTE_ANSWER_TAG,
    KEY_REMOTE_BLOCK_IDS,
    KEY_REMOTE_DP_RANK,
    KEY_REMOTE_DP_SIZE,
    KEY_REMOTE_ENGINE_ID,
    KEY_REMOTE_HANDSHAKE_PORT,
    KEY_REMOTE_HOLD_UNTIL_MS,
    KEY_REMOTE_HOST,
    KEY_REMOTE_INCARNATIONS,
    KEY_REMOTE_NOTIFY_PORT,
    KEY_REMOTE_NUM_TOKENS,
    KEY_REMOTE_PROMPT_DIGEST,
    KEY_REMOTE_TP_SIZE,
    KEY_TRANSFER_ID,
    KvTransferParams,
    ZmqAddress,
    answer_bytes,
    parse_kv_transfer_params,
)
from moriio_native.control.messages import hold_until_ms
from moriio_native.control.security import MessageAuth
from moriio_native.errors import InvalidArgumentError
from moriio_native.pd.groups import GroupedBlocks, holds_running_state
from moriio_native.vllm.config import ConnectorConfig
from moriio_native.vllm.hybrid import HybridLayout
from moriio_native.vllm.metadata import (
    MoRIIONativeMetadata,
    RankIncarnation,
    RecvTask,
    SaveTask,
    SendTask,
)
from moriio_native.vllm.prompt_digest import prompt_digest

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("moriio_native.vllm.scheduler")

_ABORTED = (
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
    RequestStatus.FINISHED_IGNORED,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _computed_prompt_tokens(request: Request) -> int:
    """The prompt tokens whose KV a finished prefill request holds: all of its prompt (as its
    backoff left it), never more than it computed."""
    return min(request.num_computed_tokens, request.num_prompt_tokens)


class SchedulerSide:
    """Per-request planning for the scheduler process. Not thread-safe (vLLM's scheduler
    thread is the only caller)."""

    def __init__(
        self,
        config: ConnectorConfig,
        block_size: int,
        dp_rank: int,
        hybrid: HybridLayout,
    ) -> None:
        self.config = config
        self._auth = MessageAuth(config.auth_secret)  # tags and checks prefill answers
        self.block_size = block_size
        self.dp_rank = dp_rank
        # vLLM's KV-cache groups: tasks carry positional per-group ids (pd.groups).
        self.hybrid = hybrid
        # P requests whose prompt was cut by the hybrid layout's backoff (once per request).
        self._truncated: set[str] = set()
        self._kv_cache_manager: KVCacheManager | None = None
        # Locally computed tokens D reported to get_num_new_matched_tokens, per request.
        self._local_tokens: dict[str, int] = {}
        # D requests whose load (or release) is planned; a second allocation is ignored.
        self._planned: set[str] = set()
        # P (WRITE) requests not yet at their last prompt chunk.
        self._to_save: dict[str, tuple[Request, KvTransferParams]] = {}
        # P (WRITE) requests whose blocks went to the workers, with their params.
        self._saved: dict[str, KvTransferParams] = {}
        # P (WRITE) requests vLLM preempted after that (it freed those blocks): their save was
        # dropped, and they run on, recomputed, without transfer.
        self._dropped: set[str] = set()
        # P requests finished with delay_free whose blocks the workers have not released yet.
        self._held: set[str] = set()
        self._invalid_logged: set[str] = set()
        # D (READ) requests' verdict on whether their prefill's answer is for their prompt.
        self._prompt_verdicts: dict[str, bool] = {}
        # Live requests' parsed kv_transfer_params (None: invalid), by the dict they came in.
        self._parsed: dict[str, tuple[Any, KvTransferParams | None]] = {}
        # Transfer ids of live requests: the first request naming one owns it (until it ends;
        # on the prefill, until its blocks are freed), and one that names a transfer id
        # another owns runs without KV transfer (_claim).
        self._transfer_owners: dict[str, str] = {}  # transfer id -> request id
        self._claimed: dict[str, str] = {}  # request id -> the transfer id it owns
        self._duplicates: set[str] = set()  # requests refused a transfer id another owns
        self._recv: list[RecvTask] = []
        self._send: list[SendTask] = []
        # The workers' incarnations by TP rank (set once they registered their caches); the
        # prefill's answers carry them, and a decode reads only from those processes.
        self._incarnations: tuple[str, ...] | None = None
        self._incarnations_missing_logged = False
        self._max_tokens_logged = False  # a WRITE prefill request's max_tokens cut (once)

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager

    # ---- helpers ------------------------------------------------------------------------------

    def _params(self, request: Request) -> KvTransferParams | None:
        """The request's validated kv_transfer_params, or None (absent or invalid: a request
        with bad params is served as an ordinary request, after one warning)."""
        raw = request.kv_transfer_params
        if not raw:
            return None
        rid = request.request_id
        cached = self._parsed.get(rid)
        if cached is not None and cached[0] is raw:
            params = cached[1]
        else:
            params = self._parse(rid, raw)
            self._parsed[rid] = (raw, params)
        if params is None:
            return None
        return params if self._claim(rid, params) else None

    def _parse(self, rid: str, raw: Any) -> KvTransferParams | None:
        """Request ``rid``'s params parsed (None, logged: invalid). Once per request: vLLM asks
        about a waiting request every step, and its params may name up to 2^20 block ids."""
        try:
            params = parse_kv_transfer_params(raw)
        except InvalidArgumentError as exc:
            logger.warning(
                "request %s: ignoring kv_transfer_params (%s); it runs without KV transfer",
                rid,
                exc,
            )
            return None
        return params if self._answer_trusted(rid, params) else None

    def _answer_trusted(self, rid: str, params: KvTransferParams) -> bool:
        """Whether D may act on the prefill answer ``params`` carries (its block ids): always
        without a secret; with one, only when the answer's tag is the secret's (logged
        otherwise: the request runs without KV transfer)."""
        if not self._auth.enabled or params.remote_block_ids is None:
            return True
        if self._auth.answer_tag_matches(params.answer_bytes(), params.remote_answer_tag):
            return True
        logger.warning(
            "request %s (transfer %s): its prefill answer is %s (auth_secret is set here: a "
            "forged answer, one from a prefill with another secret or an older version, or a "
            "proxy that drops %s); it runs without KV transfer",
            rid,
            params.transfer_id,
            "not signed" if params.remote_answer_tag is None else "signed with another secret",
            KEY_REMOTE_ANSWER_TAG,
        )
        return False

    def _claim(self, rid: str, params: KvTransferParams) -> bool:
        """Whether request ``rid`` may use its transfer id: the first live request naming it
        owns it. Both instances keep a transfer's state by its id alone, so a second live
        request with the same id (a retried or duplicated request, a client's own params)
        would take over the first one's records: the first would then wait for good or strand
        its blocks, and a synchronous READ could compute on blocks never loaded. It runs
        without KV transfer instead (refused once, for its whole life)."""
        if rid in self._duplicates:
            return False
        owner = self._transfer_owners.setdefault(params.transfer_id, rid)
        if owner == rid:
            self._claimed[rid] = params.transfer_id
            return True
        self._duplicates.add(rid)
        logger.warning(
            "request %s: transfer %s belongs to live request %s; this request runs without KV "
            "transfer%s",
            rid,
            params.transfer_id,
            owner,
            " (its prefill is this instance, which holds that request's blocks until "
            "abort_timeout: have the proxy pick another instance for the decode leg)"
            if params.remote_engine_id == self.config.engine_id
            else "",
        )
        return False

    def _release_claim(self, rid: str) -> None:
        """``rid`` ended (on the prefill: its blocks were freed): its transfer id is free."""
        self._duplicates.discard(rid)
        tid = self._claimed.pop(rid, None)
        if tid is not None and self._transfer_owners.get(tid) == rid:
            del self._transfer_owners[tid]

    def _prefill_peer(self, request: Request, params: KvTransferParams) -> ZmqAddress | None:
        try:
            return params.peer_address(request.request_id, is_producer=False)
        except InvalidArgumentError as exc:
            if request.request_id not in self._invalid_logged:
                self._invalid_logged.add(request.request_id)
                logger.warning(
                    "request %s (transfer %s): no usable prefill address (%s); computing locally",
                    request.request_id,
                    params.transfer_id,
                    exc,
                )
            return None

    def _is_remote_prefill(self, params: KvTransferParams | None) -> bool:
        return params is not None and params.do_remote_prefill and self.config.is_consumer

    def _is_remote_decode(self, params: KvTransferParams | None) -> bool:
        return params is not None and params.do_remote_decode and self.config.is_producer

    def _release_task(
        self, request: Request, params: KvTransferParams, peer: ZmqAddress
    ) -> RecvTask:
        return RecvTask(
            req_id=request.request_id,
            transfer_id=params.transfer_id,
            peer=peer,
            remote_engine_id=params.remote_engine_id,
            remote_dp_rank=params.remote_dp_rank,
            remote_tp_size=params.remote_tp_size,
            remote_incarnations=params.remote_incarnations,
            remote_hold_until_ms=params.remote_hold_until_ms,
        )

    def _release_if_answered(
        self, request: Request, params: KvTransferParams, peer: ZmqAddress
    ) -> None:
        """Queue the release of a load that will not happen. In READ mode only for a request
        that carries the prefill's answer: the prefill frees a transfer's blocks on its
        release, even one that comes before its request finished, so a release for an id the
        request holds no answer of (a client's own params naming another request's transfer)
        would free that request's blocks before its genuine decode read them."""
        if self.config.mode == "read" and (
            params.remote_block_ids is None or params.remote_engine_id is None
        ):
            logger.info(
                "request %s (transfer %s) carries no answer of the prefill "
                "(remote_block_ids, remote_engine_id): no release sent",
                request.request_id,
                params.transfer_id,
            )
            return
        self._recv.append(self._release_task(request, params, peer))

    def set_incarnations(self, ranks: Mapping[Any, object]) -> None:
        """The workers' incarnations (vLLM's ``set_xfer_handshake_metadata``, once every worker
        registered its caches), by the TP rank each worker states. Another set of ranks than
        this instance's is logged and changes nothing (never raised: vLLM calls this while its
        engine starts); the prefill's answers then carry no incarnations."""
        found = {m.tp_rank: m.incarnation for m in ranks.values() if isinstance(m, RankIncarnation)}
        expect = set(range(self.config.tp_size))
        if set(found) != expect or len(found) != len(ranks):
            logger.error(
                "connector %s: handshake metadata %s, expected one RankIncarnation for each TP "
                "rank %s; the prefill's answers carry no incarnations (decodes refuse them "
                "unless 'require_incarnation' is false)",
                self.config.engine_id,
                {k: type(m).__name__ for k, m in ranks.items()},
                sorted(expect),
            )
            return
        self._incarnations = tuple(found[r] for r in sorted(found))

    # ---- vLLM hooks ---------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """A request vLLM admits, before its prefix-cache lookup: a prefill for a remote decode
        is cut here (its prompt's backoff; in WRITE mode its output to one token), never once
        vLLM measured its cache hit on the whole prompt."""
        params = self._params(request)
        if not self._is_remote_decode(params):
            return
        self._truncate_for_prefill(request)
        if self.config.mode == "write":
            self._one_token_for_write(request)

    def _one_token_for_write(self, request: Request) -> None:
        """WRITE: the prompt's blocks go to the workers at its last chunk (the SaveTask) and
        are written when the decode announces; a request that ran on could be preempted
        meanwhile, and vLLM would free those blocks to another request while they are written.
        Its decode generates the output: the prefill's ends after its first token."""
        if request.max_tokens is None or request.max_tokens <= 1:
            return
        if not self._max_tokens_logged:
            self._max_tokens_logged = True
            logger.warning(
                "request %s asked a WRITE-mode prefill for %d tokens; a prefill for a remote "
                "decode ends after its first token (its decode generates the rest); logged "
                "once",
                request.request_id,
                request.max_tokens,
            )
        request.max_tokens = 1

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = self._params(request)
        rid = request.request_id
        if not self._is_remote_prefill(params) or rid in self._planned:
            return 0, False
        assert params is not None
        if self._prefill_peer(request, params) is None:
            return 0, False
        return self._grouped_matched_tokens(request, params, num_computed_tokens)

    # ---- grouped (hybrid KV-cache manager) ---------------------------------------------------

    def _truncate_for_prefill(self, request: Request) -> None:
        """P side: leave the prompt's last ``prefill_backoff`` tokens to the decode (Mamba
        state cannot be rewound to recompute them there); the request then ends after one
        token, as a prefill for a remote decode does."""
        backoff = self.hybrid.prefill_backoff()
        rid = request.request_id
        if not backoff or rid in self._truncated or request.num_prompt_tokens <= backoff:
            return
        self._truncated.add(rid)
        # Every per-position view of the prompt: token ids, embeddings (a prompt given as
        # embeddings, or a mixed one, one row per position) and the mixed prompt's mask.
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-backoff:]
        if request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[:-backoff]
        if request.prompt_is_token_ids is not None:
            request.prompt_is_token_ids = request.prompt_is_token_ids[:-backoff]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        if request.block_hashes:
            # A hash of a block reaching past the new end names tokens the prefill no longer
            # holds, and vLLM extends the list from its length, so it would never be
            # corrected: hash again the tokens kept (in place: the hash lists of vLLM's
            # groups view this list).
            request.block_hashes.clear()
            request.update_block_hashes()

    def _grouped_end(self, request: Request) -> int:
        """The prompt tokens a grouped load covers: all but the last in READ (computed here
        to sample the next token), all but the prefill's backoff in WRITE."""
        if self.config.mode == "read":
            return request.num_prompt_tokens - 1
        return request.num_prompt_tokens - self.hybrid.prefill_backoff()

    def _grouped_matched_tokens(
        self, request: Request, params: KvTransferParams, num_computed_tokens: int
    ) -> tuple[int, bool]:
        rid = request.request_id
        remote = params.remote_block_ids or ()
        if self.config.mode == "read" and (
            len(remote) != len(self.hybrid.groups) or params.remote_engine_id is None
        ):
            if rid not in self._invalid_logged:
                self._invalid_logged.add(rid)
                logger.warning(
                    "request %s (transfer %s): READ needs remote_engine_id and one list of "
                    "remote_block_ids per KV-cache group (%d, got %d); computing locally",
                    rid,
                    params.transfer_id,
                    len(self.hybrid.groups),
                    len(remote),
                )
            return 0, False
        if self.config.mode == "read" and not self._answer_is_for_this_prompt(request, params):
            return 0, False
        self._local_tokens[rid] = num_computed_tokens
        count = max(self._grouped_end(request) - num_computed_tokens, 0)
        async_load = self.config.mode == "write" or self.config.read_loading == "async"
        return count, count > 0 and async_load

    def _answer_is_for_this_prompt(self, request: Request, params: KvTransferParams) -> bool:
        """READ: whether the prefill's answer is for this request's prompt over every position
        the request would load: the positions the prefill computed (``remote_num_tokens``)
        reach the load's end, and their digest (``remote_prompt_digest``) is this prompt's
        over the same positions. Another prompt here than the prefill's (a client's own
        params pairing a genuine answer with its own prompt, instances that tokenize
        differently) would have positions loaded as computed that hold another prompt's KV, or
        none, and kept in the prefix cache under this prompt's tokens; such a request, or an
        answer without those keys, is computed locally (its answer's blocks released). Decided
        once per request: vLLM asks about a waiting request every step."""
        rid = request.request_id
        verdict = self._prompt_verdicts.get(rid)
        if verdict is None:
            why = self._prompt_mismatch(request, params)
            verdict = self._prompt_verdicts[rid] = not why
            if why:
                logger.warning(
                    "request %s (transfer %s): %s; computing locally", rid, params.transfer_id, why
                )
        return verdict

    def _prompt_mismatch(self, request: Request, params: KvTransferParams) -> str:
        """Why the answer ``params`` is not for this request's prompt ("": it is)."""
        computed, digest = params.remote_num_tokens, params.remote_prompt_digest
        if computed is None or digest is None:
            if not self.config.require_prompt_match:
                return ""  # the operator's choice: a proxy that drops the keys
            return (
                f"the prefill's answer states no {KEY_REMOTE_NUM_TOKENS} or "
                f"{KEY_REMOTE_PROMPT_DIGEST} (run the same connector version on both "
                "instances; the proxy must pass both keys on, or set 'require_prompt_match': "
                "false to read such answers unchecked)"
            )
        end = self._grouped_end(request)
        if end > computed:
            return (
                f"its prompt needs the KV of {end} tokens, the prefill computed {computed} "
                "(not the prompt the prefill answered)"
            )
        if end != computed and holds_running_state(self.hybrid.groups):
            return (
                f"it takes {end} tokens as computed, but the prefill's Mamba state holds "
                f"exactly its {computed}"
            )
        if computed > request.num_prompt_tokens or prompt_digest(request, computed) != digest:
            return (
                f"its prompt's first {computed} positions are not the ones the prefill "
                "computed (another prompt, tokenizer, multimodal input, cache salt or LoRA)"
            )
        return ""

    def _grouped_recv_task(
        self,
        request: Request,
        params: KvTransferParams,
        peer: ZmqAddress,
        blocks: KVCacheBlocks,
        local_tokens: int | None,
        num_external_tokens: int,
    ) -> RecvTask:
        hybrid = self.hybrid
        end_default = self._grouped_end(request)
        if local_tokens is None:
            local_tokens = end_default - num_external_tokens
        end = local_tokens + num_external_tokens
        error = ""
        try:
            local = hybrid.select(blocks.get_block_ids())
        except ValueError as exc:
            local, error = tuple(() for _ in hybrid.groups), str(exc)
        if self.config.mode == "read":
            assert params.remote_block_ids is not None
            grouped = GroupedBlocks(local, tuple(params.remote_block_ids), local_tokens, end)
        else:
            grouped = GroupedBlocks(
                hybrid.announced(local, local_tokens, end), (), local_tokens, end
            )
        return dataclasses.replace(
            self._release_task(request, params, peer),
            local_block_ids=hybrid.destination_ids(local, local_tokens, end),
            report_done=self.config.mode == "write" or self.config.read_loading == "async",
            error=error,
            grouped=grouped,
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = self._params(request)
        rid = request.request_id
        if self._is_remote_decode(params):
            assert params is not None
            if self.config.mode == "write" and rid not in self._saved and rid not in self._dropped:
                self._to_save[rid] = (request, params)
            return
        if not self._is_remote_prefill(params) or rid in self._planned:
            return
        assert params is not None
        peer = self._prefill_peer(request, params)
        if peer is None:
            return
        self._planned.add(rid)
        local_tokens = self._local_tokens.pop(rid, None)
        if num_external_tokens <= 0:
            # Full local prefix hit (or nothing loadable): the prefill only needs its release.
            self._release_if_answered(request, params, peer)
            return
        self._recv.append(
            self._grouped_recv_task(
                request, params, peer, blocks, local_tokens, num_external_tokens
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MoRIIONativeMetadata:
        self._drop_preempted_saves(scheduler_output.preempted_req_ids or set())
        meta = MoRIIONativeMetadata(recv=self._recv, send=self._send)
        self._recv, self._send = [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for rid, (request, params) in list(self._to_save.items()):
            n = scheduled.get(rid, 0)
            if n <= 0 or request.num_computed_tokens + n < request.num_prompt_tokens:
                continue
            del self._to_save[rid]
            meta.save.append(self._save_task(request, params, scheduler_output))
            self._saved[rid] = params
        return meta

    def _drop_preempted_saves(self, preempted: set[str]) -> None:
        """WRITE: requests vLLM preempted after their blocks went to the workers. vLLM freed
        those blocks (it does not ask the connector; with async scheduling a request can be
        preempted after its last prompt chunk, before its one token is processed) and will
        recompute the request: the workers stop its writes and tell its decode write_failed
        (it recomputes too), before this step's forward reuses the blocks."""
        for rid in preempted & self._saved.keys():
            params = self._saved.pop(rid)
            self._dropped.add(rid)
            logger.warning(
                "request %s (transfer %s) was preempted after its prompt's blocks went to the "
                "workers; its WRITE is dropped (its decode recomputes)",
                rid,
                params.transfer_id,
            )
            self._send.append(SendTask(rid, params.transfer_id, aborted=True, preempted=True))

    def _save_task(
        self, request: Request, params: KvTransferParams, scheduler_output: SchedulerOutput
    ) -> SaveTask:
        rid = request.request_id
        groups = None
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is not None:
            groups = state.get_block_ids(rid)
        if groups is None:
            assert self._kv_cache_manager is not None, "the KV cache manager is not bound"
            groups = self._kv_cache_manager.get_block_ids(rid)
        n_prompt = _cdiv(request.num_prompt_tokens, self.block_size)
        return SaveTask(
            req_id=rid,
            transfer_id=params.transfer_id,
            block_ids=tuple(groups[0][:n_prompt]),
            num_prompt_blocks=n_prompt,
            peer=self._decode_peer(rid, params),
            remote_tp_size=params.remote_tp_size,
            groups=self.hybrid.select(groups),
            num_tokens=request.num_prompt_tokens,
        )

    @staticmethod
    def _decode_peer(rid: str, params: KvTransferParams) -> ZmqAddress | None:
        """The decode instance a WRITE prefill request names (None, logged: none)."""
        try:
            return params.peer_address(rid, is_producer=True)
        except InvalidArgumentError as exc:
            logger.warning("request %s: no decode address in the request (%s)", rid, exc)
            return None

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's request_finished(_all_groups): ``block_ids`` holds one list per KV-cache
        group (one group without the hybrid KV-cache manager)."""
        rid = request.request_id
        try:
            return self._request_finished(request, block_ids)
        finally:
            # Last: the parsing there is kept per request (bad params logged once), and claims
            # its transfer id, which a request whose blocks stay held keeps.
            self._invalid_logged.discard(rid)
            self._parsed.pop(rid, None)
            self._prompt_verdicts.pop(rid, None)
            if rid not in self._held:
                self._release_claim(rid)

    def _request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._local_tokens.pop(rid, None)
        self._truncated.discard(rid)
        params = self._params(request)
        if self._is_remote_prefill(params):
            assert params is not None
            if rid not in self._planned:
                # Ended before it was ever scheduled: the prefill still holds its blocks.
                peer = self._prefill_peer(request, params)
                if peer is not None:
                    self._release_if_answered(request, params, peer)
            elif request.status in _ABORTED:
                # Aborted while the prefill may be writing its blocks (vLLM keeps them until the
                # workers report the load): the workers give up on the WRITE now.
                peer = self._prefill_peer(request, params)
                if peer is not None:
                    self._recv.append(
                        dataclasses.replace(self._release_task(request, params, peer), aborted=True)
                    )
            self._planned.discard(rid)
            return False, None
        if not self._is_remote_decode(params):
            return False, None
        assert params is not None
        self._to_save.pop(rid, None)
        aborted = request.status in _ABORTED
        if self.config.mode == "write":
            if rid in self._dropped:
                self._dropped.discard(rid)  # its workers' part ended when it was dropped
                return False, None
            if rid not in self._saved:
                # Nothing was handed to the workers and nothing is in flight (its blocks are
                # freed now); they only tell the decode ranks that announce its blocks.
                self._send.append(
                    SendTask(
                        rid,
                        params.transfer_id,
                        aborted=True,
                        unsaved=True,
                        peer=self._decode_peer(rid, params),
                        remote_tp_size=params.remote_tp_size,
                    )
                )
                return False, None
            del self._saved[rid]
            self._send.append(SendTask(rid, params.transfer_id, aborted=aborted))
            self._held.add(rid)
            if aborted:
                return True, None
            return True, self._returned_params(request, params, self.hybrid.select(block_ids))
        if aborted or not any(block_ids):
            return False, None
        selected = self.hybrid.select(block_ids)
        answered = tuple(b for group in selected for b in group)
        returned = self._returned_params(request, params, selected)
        self._send.append(
            SendTask(
                rid,
                params.transfer_id,
                block_ids=answered,
                hold_until_ms=returned.get(KEY_REMOTE_HOLD_UNTIL_MS, 0),
                group_sizes=tuple(len(group) for group in selected),
            )
        )
        self._held.add(rid)
        return True, returned

    def _returned_params(
        self, request: Request, params: KvTransferParams, selected: tuple[tuple[int, ...], ...]
    ) -> dict[str, Any]:
        """What the proxy forwards to the decode instance (vLLM MoRIIO key names): the
        block ids of the transfer groups (``selected``: HybridGroups.select's) flat for one
        group, one list per transfer group otherwise; in READ mode also the prompt tokens whose
        KV they hold and those tokens' digest, which the decode checks its prompt against."""
        cfg = self.config
        remote_ids: list[Any] = [list(g) for g in selected]
        if len(remote_ids) == 1:
            remote_ids = remote_ids[0]
        out: dict[str, Any] = {
            KEY_DO_REMOTE_PREFILL: True,
            KEY_DO_REMOTE_DECODE: False,
            KEY_REMOTE_BLOCK_IDS: remote_ids,
            KEY_REMOTE_ENGINE_ID: cfg.engine_id,
            KEY_REMOTE_HOST: cfg.host_ip,
            KEY_REMOTE_HANDSHAKE_PORT: cfg.handshake_port,
            KEY_REMOTE_NOTIFY_PORT: cfg.notify_port,
            KEY_REMOTE_DP_RANK: self.dp_rank,
            KEY_REMOTE_DP_SIZE: cfg.dp_size,
            KEY_REMOTE_TP_SIZE: cfg.tp_size,
            KEY_LEGACY_TP_SIZE: cfg.tp_size,
            KEY_TRANSFER_ID: params.transfer_id,
        }
        if cfg.mode == "read":
            # The decode reads only if its READ ends before this, and only for this prompt.
            out[KEY_REMOTE_HOLD_UNTIL_MS] = hold_until_ms(cfg.abort_timeout)
            num_tokens = _computed_prompt_tokens(request)
            out[KEY_REMOTE_NUM_TOKENS] = num_tokens
            out[KEY_REMOTE_PROMPT_DIGEST] = prompt_digest(request, num_tokens)
        if self._incarnations is not None:
            out[KEY_REMOTE_INCARNATIONS] = list(self._incarnations)
        elif not self._incarnations_missing_logged:
            self._incarnations_missing_logged = True
            logger.error(
                "connector %s: the workers' incarnations never reached the scheduler (vLLM did "
                "not call set_xfer_handshake_metadata); decode instances will refuse to read "
                "this prefill's KV and recompute",
                cfg.engine_id,
            )
        if self._auth.enabled:
            answer = answer_bytes(
                params.transfer_id,
                selected,
                cfg.engine_id,
                self._incarnations,
                out.get(KEY_REMOTE_HOLD_UNTIL_MS),
                out.get(KEY_REMOTE_NUM_TOKENS),
                out.get(KEY_REMOTE_PROMPT_DIGEST),
            )
            out[KEY_REMOTE_ANSWER_TAG] = self._auth.tag_answer(answer)
        return out

    def update_connector_output(
        self, finished_sending: set[str] | None, invalid_block_ids: set[int] | None
    ) -> None:
        """The workers released ``finished_sending``'s blocks (vLLM frees them now), and
        failed to load ``invalid_block_ids``. A synchronous load's blocks entered vLLM's prefix
        cache when it was scheduled, and vLLM's recompute policy leaves a failed one's there,
        trusting the request to recompute them: an abort or a preemption first would leave
        them cached holding no one's KV. They leave the prefix cache now (the request still
        recomputes into them; an async load's are not cached yet, and stay as they are)."""
        if invalid_block_ids:
            assert self._kv_cache_manager is not None, "the KV cache manager is not bound"
            self._kv_cache_manager.evict_blocks(set(invalid_block_ids))
        if finished_sending:
            self._held.difference_update(finished_sending)
            for rid in finished_sending:
                self._release_claim(rid)

    def has_pending_block_frees(self) -> bool:
        """Whether finished requests still hold blocks that a transfer will release (bounded
        by abort_timeout), so vLLM may wait for them instead of preempting."""
        return bool(self._held)


__all__ = ["SchedulerSide"]
