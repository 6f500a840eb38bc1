"""``moriio-native demo``: a real prefill -> decode KV transfer on this machine, every byte checked.

What runs:

* a **prefill** worker and a **decode** worker, each with its own :class:`~moriio_native.Engine`
  and its own KV caches for a model preset (:mod:`moriio_native.presets`) carved from ONE
  page-aligned shared backing in vLLM's standardized layout. With the UCX backend the prefill
  worker is a separate process (``multiprocessing`` spawn); the loopback backend only works
  inside one process, so there both workers are threads of this process (the output says so).
* the **control plane** of :mod:`moriio_native.control` between them, exactly as the vLLM
  connector uses it: the decode side fetches the prefill engine's metadata from its
  ``HandshakeServer``, notifications (``Release``, ``RemoteBlocks``, ``WriteDone``) travel
  over ZMQ to each side's ``NotifyListener``, every message carries an HMAC tag (a random
  secret per run) and dialling is limited to an allowlist (127.0.0.1). Sockets bind to
  127.0.0.1 on free ports.
* the part a router/proxy plays in a deployment (sending the request to prefill, handing its
  ``kv_transfer_params`` to decode) is a ``multiprocessing`` pipe; the request id embeds both
  sides' control addresses, as vLLM's MoRIIO proxy builds it.

Per request: prefill takes random free blocks and stamps a recognisable pattern into them (a
fixed random block per cache XOR a tag derived from (transfer id, cache, block position)); the
decode side takes random, non-contiguous destination blocks, moves the KV with READ (decode
pulls with ``Engine.read``, then sends ``Release``) or WRITE (decode sends ``RemoteBlocks``;
prefill calls ``write_layer`` per cache, ``seal``, then sends ``WriteDone``), and then checks

1. every destination byte against the pattern, through :func:`moriio_native.kvcache.logical_view`
   (plain numpy indexing, independent of the native layout engine), and
2. that no byte of its backing outside the request's blocks changed (a full compare against a
   model of what the backing must hold).

At the end the prefill worker reports how many of its blocks are still held: all must have been
released. One request is in flight at a time, so the latencies are not queueing artefacts.

Public API: :class:`DemoConfig`, :func:`run_demo` (returns :class:`DemoResult`), :func:`main`
(the CLI). ``run_demo`` blocks until done; every wait is bounded by ``DemoConfig.timeout``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, Literal

import numpy as np

from moriio_native import control as ctl
from moriio_native import kvcache as kc
from moriio_native.control.messages import hold_until_ms
from moriio_native.engine import Engine, available_backends, choose_backend
from moriio_native.errors import BackendUnavailableError, InvalidArgumentError, MoriioError
from moriio_native.layout import BlockPairs, LayerLayout, block_template, describe_layer
from moriio_native.pd import PdConfig, PdCore, RecvTask, SaveTask, SendTask
from moriio_native.presets import DEFAULT_PRESET, get_preset
from moriio_native.verify import LayerChecksums

logger = logging.getLogger("moriio_native.demo")

Mode = Literal["read", "write"]
ModeChoice = Literal["read", "write", "both"]
BackendChoice = Literal["auto", "ucx", "loopback"]
Fault = Literal["dst", "outside"]

_HOST = "127.0.0.1"
_PREFILL_ID = "demo-prefill-0"  # the instance ids requests name (remote_engine_id)
_DECODE_ID = "demo-decode-0"
# Each instance has one rank; its engine and protocol core use the rank's id, as a vLLM worker.
_PREFILL_RANK = f"{_PREFILL_ID}/dp0/tp0"
_DECODE_RANK = f"{_DECODE_ID}/dp0/tp0"
_IDLE_POLL_S = 0.005
_MAX_REPORTED = 10
_NOISE_CHUNK = (1 << 20) + 56

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_SETUP_FAILED = 3
EXIT_INTERRUPTED = 130


class DemoError(MoriioError, RuntimeError):
    """The demo could not run (a worker failed to start, a peer stopped answering)."""


# The longest --timeout: what multiprocessing Connection.poll takes (INT_MAX ms, 24.8 days).
_MAX_DEMO_TIMEOUT_S = 2_000_000.0
# The most blocks per side: a block id is at most 2^31 - 1 (control.schema.MAX_BLOCK_ID).
_MAX_DEMO_BLOCKS = 2**31


@dataclass(frozen=True)
class DemoConfig:
    """What to run. ``num_blocks`` (per side) defaults to 4 x ``blocks_per_request``;
    ``layers`` keeps only the preset's first N transformer layers; ``inject_fault`` flips one
    byte of the decode cache after the first transfer (``"dst"``: inside a destination block,
    ``"outside"``: in a block the request did not touch) to prove the checks can fail."""

    preset: str = DEFAULT_PRESET
    layers: int | None = None
    requests: int = 16
    mode: ModeChoice = "both"
    backend: BackendChoice = "auto"
    blocks_per_request: int = 4
    num_blocks: int | None = None
    timeout: float = 30.0
    seed: int = 0
    inject_fault: Fault | None = None
    # Run the protocol's end-to-end integrity check (block checksums on both sides).
    verify: bool = False

    def validated(self) -> DemoConfig:
        """A copy with defaults filled in; InvalidArgumentError naming the bad option."""
        preset = get_preset(self.preset)
        preset.shapes(self.layers)  # checks the layer count
        for name in ("requests", "blocks_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(
                    f"demo: {name} must be a positive integer, got {value!r}"
                )
        if self.mode not in ("read", "write", "both"):
            raise InvalidArgumentError(f"demo: mode must be read, write or both, got {self.mode!r}")
        if self.backend not in ("auto", "ucx", "loopback"):
            raise InvalidArgumentError(
                f"demo: backend must be auto, ucx or loopback, got {self.backend!r}"
            )
        num_blocks = self.num_blocks if self.num_blocks is not None else 4 * self.blocks_per_request
        if num_blocks < self.blocks_per_request + 1:
            raise InvalidArgumentError(
                f"demo: num_blocks ({num_blocks}) must exceed blocks_per_request "
                f"({self.blocks_per_request}) so some blocks stay untouched"
            )
        if num_blocks > _MAX_DEMO_BLOCKS:
            raise InvalidArgumentError(
                f"demo: num_blocks must be at most {_MAX_DEMO_BLOCKS} (block ids are 31-bit), "
                f"got {num_blocks}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidArgumentError(
                f"demo: seed must be a non-negative integer, got {self.seed!r}"
            )
        # What the engines take as transfer_timeout: checked here, before any worker starts.
        # ... and what its pipe waits take: Connection.poll refuses past INT_MAX milliseconds.
        if not 0.001 <= self.timeout <= _MAX_DEMO_TIMEOUT_S:
            raise InvalidArgumentError(
                f"demo: timeout must be 0.001 s to {_MAX_DEMO_TIMEOUT_S:.0f} s (24 days), got "
                f"{self.timeout!r}"
            )
        if self.inject_fault not in (None, "dst", "outside"):
            raise InvalidArgumentError(f"demo: unknown fault {self.inject_fault!r}")
        return dataclasses.replace(self, num_blocks=num_blocks)

    def modes(self) -> list[Mode]:
        return ["read", "write"] if self.mode == "both" else [self.mode]


@dataclass
class ModeStats:
    """Measurements of one transfer mode. Latency: READ from ``Engine.read`` to its completion
    event; WRITE from sending ``RemoteBlocks`` to receiving ``WriteDone`` (so it includes the
    prefill side's scheduling and one control round trip). Planning: the native copy plan of
    every cache for the request (same planner and block ids as the engine), timed beside it."""

    mode: Mode
    requests: int = 0
    verified: int = 0
    bytes: int = 0
    latencies_s: list[float] = field(default_factory=list)
    planning_s: list[float] = field(default_factory=list)
    runs: int = 0
    mismatches: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # With verify: the protocol's integrity checks that passed and failed (the decode's count).
    integrity_checks: int = 0
    integrity_failures: int = 0

    @property
    def gbps(self) -> float:
        total = sum(self.latencies_s)
        return self.bytes / total / 1e9 if total > 0 else 0.0

    def percentile_ms(self, values: Sequence[float], q: float) -> float:
        return float(np.percentile(np.asarray(values) * 1e3, q)) if values else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "requests": self.requests,
            "verified_requests": self.verified,
            "bytes": self.bytes,
            "gb_per_s": self.gbps,
            "latency_ms": {
                "p50": self.percentile_ms(self.latencies_s, 50),
                "p99": self.percentile_ms(self.latencies_s, 99),
                "max": max(self.latencies_s, default=0.0) * 1e3,
            },
            "planning_us": {
                "p50": self.percentile_ms(self.planning_s, 50) * 1e3,
                "p99": self.percentile_ms(self.planning_s, 99) * 1e3,
            },
            "engine_runs": self.runs,
            "mismatches": list(self.mismatches),
            "failures": list(self.failures),
            "integrity_checks": self.integrity_checks,
            "integrity_failures": self.integrity_failures,
        }


@dataclass
class DemoResult:
    """Everything the summary shows; ``ok`` is False on any mismatch, failed transfer or
    block the prefill side still held at the end."""

    config: DemoConfig
    backend: str
    processes: int
    backend_note: str
    caches: int
    bytes_per_block: int
    prefill_pid: int
    decode_pid: int
    modes: dict[str, ModeStats] = field(default_factory=dict)
    prefill_blocks_held: int | None = None
    prefill_releases: int = 0
    control: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and self.prefill_blocks_held == 0
            and all(not m.mismatches and not m.failures for m in self.modes.values())
            and all(m.verified == m.requests == self.config.requests for m in self.modes.values())
        )

    @property
    def verification(self) -> str:
        return "passed" if self.ok else "FAILED"

    def to_dict(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "ok": self.ok,
            "verification": self.verification,
            "preset": cfg.preset,
            "layers": cfg.layers,
            "caches": self.caches,
            "bytes_per_block": self.bytes_per_block,
            "blocks_per_request": cfg.blocks_per_request,
            "num_blocks": cfg.num_blocks,
            "backend": self.backend,
            "processes": self.processes,
            "backend_note": self.backend_note,
            "prefill_pid": self.prefill_pid,
            "decode_pid": self.decode_pid,
            "modes": {name: stats.to_dict() for name, stats in self.modes.items()},
            "prefill_blocks_held_at_end": self.prefill_blocks_held,
            "prefill_releases": self.prefill_releases,
            "control": self.control,
            "errors": list(self.errors),
        }


# ---- the pattern ------------------------------------------------------------------------------


class KvPattern:
    """Recognisable, position-dependent content for request blocks.

    Cache ``i`` has a fixed random "base block" (seeded by ``(seed, i)``); the content of the
    ``j``-th block of transfer ``t`` is that base XOR a tag of the element's width derived from
    ``(t, i, j)``. Tags of one request's blocks are distinct (also for 1-byte caches), so a
    block landing in the wrong place, a wrong offset inside a block, another cache's bytes or a
    previous request's stale bytes all fail the compare. Both sides compute it independently.
    """

    def __init__(self, cache: kc.KvCacheSet, seed: int) -> None:
        self._shapes = list(cache.shapes)
        self._bases: list[np.ndarray] = []
        for index, shape in enumerate(self._shapes):
            dtype = cache.views[shape.name].dtype  # the same-sized integer container
            per = shape.block_size // shape.kernel
            dims = (shape.planes, shape.num_heads, per, shape.kernel, shape.head_size)
            raw = np.random.default_rng([seed, index]).bytes(int(np.prod(dims)) * dtype.itemsize)
            self._bases.append(np.frombuffer(raw, dtype=dtype).reshape(dims).copy())

    def _tags(self, transfer_id: str, index: int, count: int, dtype: np.dtype) -> np.ndarray:
        bits = dtype.itemsize * 8
        h = zlib.crc32(f"{transfer_id}/{index}".encode())
        # An odd step keeps the low byte distinct for up to 256 consecutive positions.
        raw = (h + np.arange(count, dtype=np.uint64) * np.uint64(0x9E3779B1)) & np.uint64(
            (1 << bits) - 1
        )
        return raw.astype(f"u{dtype.itemsize}").view(dtype)

    def blocks(self, transfer_id: str, index: int, count: int) -> np.ndarray:
        """The expected logical content of ``count`` blocks of cache ``index``:
        ``[count, planes, heads, kernel_blocks, kernel_block_size, head_size]``."""
        base = self._bases[index]
        tags = self._tags(transfer_id, index, count, base.dtype)
        return base[None] ^ tags.reshape(-1, 1, 1, 1, 1, 1)

    def stamp(self, cache: kc.KvCacheSet, transfer_id: str, block_ids: Sequence[int]) -> None:
        """Write the pattern of ``transfer_id`` into ``block_ids`` of every cache of ``cache``."""
        ids = np.asarray(block_ids, dtype=np.int64)
        for index, shape in enumerate(self._shapes):
            view = kc.logical_view(cache.views[shape.name], shape)
            view[ids] = self.blocks(transfer_id, index, len(ids))


def fill_noise(backing: np.ndarray, seed: int) -> None:
    """Fill ``backing`` with reproducible noise quickly: a random chunk of a little over 1 MiB
    repeated (its odd length keeps equal offsets of different blocks holding different bytes).
    Noise only has to differ from the pattern; a full random fill of a large cache takes
    seconds on a small machine."""
    chunk = np.frombuffer(np.random.default_rng(seed).bytes(_NOISE_CHUNK), dtype=np.uint8)
    flat = backing.reshape(-1)
    for start in range(0, flat.size, chunk.size):
        end = min(flat.size, start + chunk.size)
        flat[start:end] = chunk[: end - start]


def _twin_views(backing: np.ndarray, cache: kc.KvCacheSet) -> dict[str, np.ndarray]:
    """Views into ``backing`` (a copy of ``cache.backing``) laid out exactly like ``cache``."""
    out: dict[str, np.ndarray] = {}
    for shape in cache.shapes:
        view = cache.views[shape.name]
        flat = backing[cache.offsets[shape.name] :]
        usable = flat.nbytes - flat.nbytes % view.itemsize
        out[shape.name] = np.lib.stride_tricks.as_strided(
            flat[:usable].view(view.dtype), shape=view.shape, strides=view.strides
        )
    return out


def _layouts(cache: kc.KvCacheSet) -> dict[str, LayerLayout]:
    return {s.name: describe_layer(s.name, cache.views[s.name], s.spec()) for s in cache.shapes}


def _plan_seconds(
    templates: Sequence[Any], local_blocks: Sequence[int], remote_blocks: Sequence[int]
) -> tuple[float, int]:
    """Time the native copy plans of every cache for one request, as the engine computes them:
    the block pairs validated once, then each cache's cached template stamped. (seconds, runs)"""
    start = time.perf_counter()
    pairs = BlockPairs(np.asarray(local_blocks, np.int64), np.asarray(remote_blocks, np.int64))
    runs = 0
    for template in templates:
        runs += len(template.plan(pairs))
    return time.perf_counter() - start, runs


# ---- prefill worker ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _WorkerSpec:
    """What the prefill worker needs; picklable (it crosses the spawn boundary)."""

    preset: str
    layers: int | None
    num_blocks: int
    backend: str
    secret: str
    timeout: float
    seed: int
    verify: bool = False


def _security(secret: str) -> ctl.ControlSecurity:
    return ctl.ControlSecurity(ctl.MessageAuth(secret), ctl.PeerAllowlist([_HOST]))


class _EventLog:
    """The protocol core's stats sink: keeps each completed transfer's engine event (the
    demo reports its bytes and runs) and counts the rest."""

    def __init__(self) -> None:
        self.events: dict[str, Any] = {}
        self.failures = 0
        self.handshakes = 0
        self.peers_evicted = 0
        self.peers_refused = 0
        self.quarantined_blocks = 0
        self.verified = 0
        self.verify_failures = 0
        self.confirmed_reads = 0
        self.confirm_failures = 0

    def record(self, *, ok: bool) -> None:
        self.failures += not ok

    def record_transfer(self, event: Any, groups: int = 1) -> None:
        # The demo's model has one KV-cache group: ``groups`` is always 1 here.
        self.events[event.transfer_id] = event

    def record_handshake(self) -> None:
        self.handshakes += 1

    def record_peer_bound(self, *, evicted: bool) -> None:
        if evicted:
            self.peers_evicted += 1
        else:
            self.peers_refused += 1

    def record_quarantine(self, blocks: int) -> None:
        self.quarantined_blocks += blocks

    def record_verify(self, *, ok: bool) -> None:
        if ok:
            self.verified += 1
        else:
            self.verify_failures += 1

    def record_confirm(self, *, ok: bool) -> None:
        if ok:
            self.confirmed_reads += 1
        else:
            self.confirm_failures += 1


def _core(
    engine: Engine,
    engine_id: str,
    mode: Mode,
    *,
    producer: bool,
    timeout: float,
    secret: str,
    checksums: LayerChecksums | None,
) -> tuple[PdCore, _EventLog]:
    """One side's protocol core for ``mode``, started on free ports of 127.0.0.1: the same
    core the vLLM connector runs (:mod:`moriio_native.pd`); ``checksums`` turns verify on."""
    log = _EventLog()
    core = PdCore(
        PdConfig(
            engine_id=engine_id,
            mode=mode,
            producer=producer,
            consumer=not producer,
            host_ip=_HOST,
            handshake_port=0,
            notify_port=0,
            transfer_timeout=timeout,
            # Long enough that in a healthy run every prefill block is freed by its release.
            abort_timeout=max(4 * timeout, 60.0),
            quarantine_timeout=max(4 * timeout, 60.0),
            verify=checksums is not None,
        ),
        _security(secret),
        log,
        engine=lambda: engine,
        bind_host=_HOST,
        checksums=None if checksums is None else lambda: checksums,
    )
    core.start(0, 0)
    return core, log


def _address(core: PdCore) -> ctl.ZmqAddress:
    return ctl.ZmqAddress(*core.address())


class _PrefillWorker:
    """The prefill side: one engine and its caches; per mode a protocol core (handshake
    server, notify listener, held READs, WRITE pushes). Talks to the decode side's "router"
    over ``conn``; the protocol itself runs on the core's threads."""

    def __init__(self, spec: _WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
        self._spec = spec
        self._conn = conn
        self._rng = np.random.default_rng([spec.seed, 1])
        self._requests: dict[str, list[int]] = {}  # request id -> its blocks, until freed
        self._free: set[int] = set(range(spec.num_blocks))
        self._freed: dict[str, int] = {"read": 0, "write": 0}
        self._core: PdCore | None = None
        self._mode: Mode = "read"
        self._handshake_stats: dict[str, int] = {}
        self._listener_stats: dict[str, int] = {}
        self._stop = False

    def run(self) -> None:
        try:
            self._setup()
        except BaseException as exc:
            logger.exception("prefill worker failed to start")
            self._send({"type": "error", "message": f"prefill setup: {type(exc).__name__}: {exc}"})
            self._stop_core()
            return
        try:
            self._loop()
        except (EOFError, OSError):
            logger.warning("prefill worker: the decode side went away; stopping")
        except BaseException as exc:
            logger.exception("prefill worker failed")
            self._send({"type": "error", "message": f"prefill: {type(exc).__name__}: {exc}"})
        finally:
            self._stop_core()

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._conn.send(message)
        except (OSError, EOFError):
            logger.warning("prefill worker: cannot reach the decode side")

    def _setup(self) -> None:
        spec = self._spec
        self._shapes = get_preset(spec.preset).shapes(spec.layers)
        self._layers = [shape.name for shape in self._shapes]
        self._cache = kc.build_caches(self._shapes, spec.num_blocks)
        fill_noise(self._cache.backing, spec.seed + 101)  # unrequested blocks hold noise
        self._pattern = KvPattern(self._cache, spec.seed)
        self._engine = Engine(_PREFILL_RANK, spec.backend, transfer_timeout=spec.timeout)
        self._engine.register_kv_caches(self._cache.registrations())
        self._checksums = (
            LayerChecksums.for_registrations(self._cache.registrations()) if spec.verify else None
        )
        self._send({"type": "ready", "engine_id": _PREFILL_ID, "pid": os.getpid()})

    def _stop_core(self) -> None:
        if self._core is None:
            return
        assert self._core.server is not None and self._core.listener is not None
        for mine, theirs in (
            (self._handshake_stats, self._core.server.stats()),
            (self._listener_stats, self._core.listener.stats()),
        ):
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0) + value
        self._core.shutdown()
        self._core = None

    def _loop(self) -> None:
        while not self._stop:
            self._collect()
            if self._conn.poll(_IDLE_POLL_S):
                self._on_router(self._conn.recv())

    def _collect(self) -> None:
        """Free the blocks of requests the core reports done (released, or written)."""
        if self._core is None:
            return
        for request_id in self._core.take_reports().done_sending:
            blocks = self._requests.pop(request_id, None)
            if blocks is None:
                logger.warning("prefill: the core freed unknown request %s", request_id)
                continue
            self._free.update(blocks)
            self._freed[self._mode] += 1

    # Router messages: "mode" (a fresh core for a mode), "prefill" (run a request's prefill)
    # and "shutdown".
    def _on_router(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "mode":
            self._start_mode(message["mode"])
        elif kind == "prefill":
            self._prefill(message)
        elif kind == "shutdown":
            self._shutdown(float(message.get("grace", 5.0)))
        else:
            logger.warning("prefill worker: unknown router message %r", kind)

    def _start_mode(self, mode: Mode) -> None:
        self._drain(5.0)  # the last releases of the previous mode may still be on their way
        self._stop_core()
        self._mode = mode
        self._core, _ = _core(
            self._engine,
            _PREFILL_RANK,
            mode,
            producer=True,
            timeout=self._spec.timeout,
            secret=self._spec.secret,
            checksums=self._checksums,
        )
        self._send({"type": "mode_ready", "address": _address(self._core).format()})

    def _prefill(self, message: dict[str, Any]) -> None:
        if self._core is None:
            raise DemoError("prefill request before any mode started")
        request_id = message["request_id"]
        params = ctl.parse_kv_transfer_params(message["kv_transfer_params"])
        count = int(message["num_blocks"])
        # The previous request's release travels over ZMQ, this message over the pipe: give
        # it up to the timeout to free its blocks before refusing for want of blocks.
        deadline = time.monotonic() + self._spec.timeout
        while count > len(self._free) and self._requests and time.monotonic() < deadline:
            self._collect()
            if count > len(self._free):
                time.sleep(_IDLE_POLL_S)
        if count > len(self._free) or request_id in self._requests:
            self._send(
                {
                    "type": "prefill_failed",
                    "request_id": request_id,
                    "reason": f"transfer {params.transfer_id}: cannot allocate {count} blocks "
                    f"({len(self._free)} free) or id already in use",
                }
            )
            return
        blocks = [int(b) for b in self._rng.choice(sorted(self._free), count, replace=False)]
        self._free.difference_update(blocks)
        # The "forward pass": this request's KV lands in its blocks.
        self._pattern.stamp(self._cache, params.transfer_id, blocks)
        self._requests[request_id] = blocks
        tid = params.transfer_id
        if self._mode == "write":
            # The prompt's blocks go to the core, which pushes each layer once the decode's
            # remote_blocks arrived (the forward already ran: every layer is ready).
            decode = params.peer_address(request_id, is_producer=True)
            save = SaveTask(request_id, tid, tuple(blocks), len(blocks), decode, remote_tp_size=1)
            self._core.begin_step([save], [])
            self._core.forward_done(self._layers, None)
        # The request finished: its blocks are held until the core reports them free, at most
        # abort_timeout from the step that hands the core its send task (after this stamp).
        hold_until = hold_until_ms(self._core.cfg.abort_timeout)
        self._core.begin_step(
            [], [SendTask(request_id, tid, block_ids=tuple(blocks), hold_until_ms=hold_until)]
        )
        host, hs_port, notify_port = self._core.address()
        reply = ctl.KvTransferParams(
            transfer_id=tid,
            do_remote_prefill=True,
            remote_block_ids=(tuple(blocks),),
            remote_engine_id=_PREFILL_ID,
            remote_host=host,
            remote_handshake_port=hs_port,
            remote_notify_port=notify_port,
            remote_incarnations=(self._core.incarnation,),
            remote_hold_until_ms=hold_until,
        )
        self._send(
            {"type": "prefilled", "request_id": request_id, "kv_transfer_params": reply.to_dict()}
        )

    def _drain(self, grace: float) -> None:
        """Releases travel over ZMQ, the router's messages over the pipe: give late releases
        (and final writes) up to ``grace`` seconds to free their blocks."""
        deadline = time.monotonic() + grace
        while self._requests and time.monotonic() < deadline:
            self._collect()
            time.sleep(_IDLE_POLL_S)
        self._collect()

    def _shutdown(self, grace: float) -> None:
        self._drain(grace)
        self._stop_core()
        self._send(
            {
                "type": "stats",
                "blocks_held": self._spec.num_blocks - len(self._free),
                "releases": self._freed["read"],
                "writes": self._freed["write"],
                "listener": self._listener_stats,
                "handshake": self._handshake_stats,
            }
        )
        self._stop = True


def _prefill_main(spec: _WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of the prefill worker (process or thread)."""
    _PrefillWorker(spec, conn).run()


# ---- decode side (this process) ---------------------------------------------------------------


class _Decode:
    def __init__(self, cfg: DemoConfig, backend: str, secret: str) -> None:
        assert cfg.num_blocks is not None
        self.cfg = cfg
        self.secret = secret
        self.shapes = get_preset(cfg.preset).shapes(cfg.layers)
        self.cache = kc.build_caches(self.shapes, cfg.num_blocks)
        fill_noise(self.cache.backing, cfg.seed + 202)
        self.model = self.cache.backing.copy()  # what the backing must hold
        self.model_views = _twin_views(self.model, self.cache)
        self.pattern = KvPattern(self.cache, cfg.seed)
        self.rng = np.random.default_rng([cfg.seed, 2])
        self.engine = Engine(_DECODE_RANK, backend, transfer_timeout=cfg.timeout)
        self.engine.register_kv_caches(self.cache.registrations())
        self.checksums = (
            LayerChecksums.for_registrations(self.cache.registrations()) if cfg.verify else None
        )
        # Both sides use the same preset and block count, so the prefill caches have exactly
        # these layouts; the planning timer uses them for the remote side too. Templates are
        # built once per (peer, cache), as in the engine.
        self.templates = [block_template(lo, lo) for lo in _layouts(self.cache).values()]
        self.core: PdCore | None = None
        self.log = _EventLog()
        self.listener_stats: dict[str, int] = {}

    def start_mode(self, mode: Mode) -> ctl.ZmqAddress:
        """A fresh decode core for ``mode``; its address."""
        self.stop_core()
        self.core, self.log = _core(
            self.engine,
            _DECODE_RANK,
            mode,
            producer=False,
            timeout=self.cfg.timeout,
            secret=self.secret,
            checksums=self.checksums,
        )
        return _address(self.core)

    def stop_core(self) -> None:
        if self.core is None:
            return
        assert self.core.listener is not None
        for key, value in self.core.listener.stats().items():
            self.listener_stats[key] = self.listener_stats.get(key, 0) + value
        self.core.shutdown()
        self.core = None

    def close(self) -> None:
        self.stop_core()

    def load(self, task: RecvTask) -> str:
        """Run one load through the core; "" when it succeeded, else why it failed. Bounded:
        the core ends every load (READ: the engine's deadline; WRITE: abort_timeout)."""
        core = self.core
        assert core is not None
        core.start_loads([task])
        deadline = time.monotonic() + 2 * core.cfg.abort_timeout + core.cfg.quarantine_timeout
        while time.monotonic() < deadline:
            reports = core.take_reports()
            if task.req_id in reports.done_recving:
                if task.req_id in reports.failed_recving:
                    return reports.failures.get(task.req_id, "the load failed")
                return ""
            time.sleep(_IDLE_POLL_S)
        raise DemoError(f"transfer {task.transfer_id}: the core never ended the load")

    def verify(self, transfer_id: str, blocks: Sequence[int]) -> list[str]:
        """Every destination byte against the pattern, then the whole backing against the
        model (nothing outside the request's blocks may change). Updates the model."""
        problems: list[str] = []
        ids = np.asarray(blocks, dtype=np.int64)
        for index, shape in enumerate(self.shapes):
            expected = self.pattern.blocks(transfer_id, index, len(ids))
            actual = kc.logical_view(self.cache.views[shape.name], shape)[ids]
            # The model takes what the request's blocks hold now (reported below if wrong), so
            # the full compare that follows only sees changes outside them.
            kc.logical_view(self.model_views[shape.name], shape)[ids] = actual
            if np.array_equal(actual, expected):
                continue
            wrong = (actual != expected).reshape(len(ids), -1).sum(axis=1)
            for pos in np.flatnonzero(wrong):
                problems.append(
                    f"transfer {transfer_id}: cache {shape.name} block {int(ids[pos])} "
                    f"(request block {int(pos)}): {int(wrong[pos])} of {expected[0].size} "
                    "elements differ from the prefill pattern"
                )
        actual64, model64 = self.cache.backing.view(np.uint64), self.model.view(np.uint64)
        if not np.array_equal(actual64, model64):
            diff = np.flatnonzero(actual64 != model64)
            first = int(diff[0]) * 8
            problems.append(
                f"transfer {transfer_id}: {len(diff)} 8-byte words of the decode backing outside "
                f"the request's blocks changed; first at byte {first} ({self.locate(first)})"
            )
            self.model[:] = self.cache.backing  # report each stray write once
        return problems

    def locate(self, offset: int) -> str:
        """Which cache/block a backing byte offset belongs to (for error messages)."""
        for shape in self.shapes:
            view = self.cache.views[shape.name]
            start = self.cache.offsets[shape.name]
            axis = shape.block_axis()
            per = shape.block_size // shape.kernel
            stride = view.strides[axis] * per
            end = start + (view.shape[axis] // per) * stride
            if start <= offset < end:
                return f"cache {shape.name}, block {(offset - start) // stride}"
        return "a gap between caches"

    def inject(self, fault: Fault, blocks: Sequence[int]) -> None:
        shape = self.shapes[0]
        view = kc.logical_view(self.cache.views[shape.name], shape)
        if fault == "dst":
            target = int(blocks[0])
        else:
            target = next(b for b in range(self.cfg.num_blocks or 0) if b not in set(blocks))
        view[target, 0, 0, 0, 0, 0] ^= 1
        logger.warning("demo: injected a one-bit fault into cache %s block %d", shape.name, target)


class _Router:
    """The decode side's end of the pipe that stands in for the proxy's HTTP hop."""

    def __init__(self, conn: multiprocessing.connection.Connection, timeout: float) -> None:
        self.conn = conn
        self.timeout = timeout

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.conn.send(message)
        except (OSError, EOFError) as exc:
            raise DemoError(
                f"prefill worker went away (sending {message.get('type')!r}: {exc})"
            ) from exc

    def recv(self, what: str, timeout: float | None = None) -> dict[str, Any]:
        limit = self.timeout if timeout is None else timeout
        try:
            ready = self.conn.poll(limit)
        except (EOFError, OSError) as exc:
            raise DemoError(f"prefill worker went away while waiting for {what}") from exc
        if not ready:
            raise DemoError(f"prefill worker sent no {what} within {limit:.3g}s")
        try:
            message = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise DemoError(f"prefill worker went away while waiting for {what}") from exc
        if message.get("type") == "error":
            raise DemoError(str(message.get("message")))
        return message


def _pick_backend(choice: BackendChoice) -> tuple[str, str]:
    """(backend, note) for the requested choice (:func:`moriio_native.engine.choose_backend`,
    role ``local``); DemoError when UCX was asked for but cannot run."""
    try:
        backend = choose_backend(choice, role="local")
    except BackendUnavailableError as exc:
        raise DemoError(str(exc)) from exc
    if backend == "ucx":
        tls = f" (UCX_TLS={os.environ['UCX_TLS']})" if os.environ.get("UCX_TLS") else ""
        return "ucx", "prefill and decode are separate processes, KV moves over UCX" + tls
    ucx = {info.name: info for info in available_backends()}.get("ucx")
    why = "" if choice == "loopback" else f" (UCX unavailable: {ucx.reason if ucx else '?'})"
    return "loopback", "prefill and decode are two engines in ONE process (threads)" + why


ProgressHook = Callable[[str, int, int], None]


def run_demo(
    config: DemoConfig,
    progress: ProgressHook | None = None,
    on_start: Callable[[DemoResult], None] | None = None,
) -> DemoResult:
    """Run the demo; blocks until done. ``progress(mode, done, total)`` is called after every
    request, ``on_start(result)`` once both workers are up. Never leaves a worker behind.

    Raises InvalidArgumentError for a bad config and DemoError when the demo cannot start;
    transfer failures and mismatches are reported in the result (``ok`` False).
    """
    cfg = config.validated()
    assert cfg.num_blocks is not None
    backend, note = _pick_backend(cfg.backend)
    preset = get_preset(cfg.preset)
    secret = secrets.token_hex(32)
    spec = _WorkerSpec(
        cfg.preset, cfg.layers, cfg.num_blocks, backend, secret, cfg.timeout, cfg.seed, cfg.verify
    )
    parent_conn, child_conn = multiprocessing.Pipe()
    worker: BaseProcess | threading.Thread
    if backend == "loopback":
        worker = threading.Thread(
            target=_prefill_main, args=(spec, child_conn), name="demo-prefill", daemon=True
        )
    else:
        worker = multiprocessing.get_context("spawn").Process(
            target=_prefill_main, args=(spec, child_conn), name="moriio-demo-prefill", daemon=True
        )
    decode: _Decode | None = None
    router = _Router(parent_conn, cfg.timeout)
    shutdown_sent = False
    result: DemoResult | None = None
    try:
        worker.start()
        if isinstance(worker, BaseProcess):
            child_conn.close()  # the child holds its own copy; EOF then means it is gone
        try:
            decode = _Decode(cfg, backend, secret)
        except MemoryError as exc:  # as the prefill worker's setup reports its own
            raise DemoError(f"decode setup: {type(exc).__name__}: {exc}") from exc
        # Building and registering a large cache takes a while on a small machine.
        ready = router.recv("ready message", timeout=max(cfg.timeout, 120.0))
        if ready.get("type") != "ready":
            raise DemoError(f"prefill worker: unexpected {ready.get('type')!r} at start")
        result = DemoResult(
            config=cfg,
            backend=backend,
            processes=2 if backend != "loopback" else 1,
            backend_note=note,
            caches=len(decode.shapes),
            bytes_per_block=preset.bytes_per_block(cfg.layers),
            prefill_pid=int(ready["pid"]),
            decode_pid=os.getpid(),
        )
        if on_start is not None:
            on_start(result)
        for mode in cfg.modes():
            stats = ModeStats(mode)
            result.modes[mode] = stats
            # Each mode runs a fresh pair of protocol cores (the engines stay registered).
            router.send({"type": "mode", "mode": mode})
            started = router.recv(f"{mode} mode start")
            prefill_address = ctl.ZmqAddress.parse(started["address"])
            decode_address = decode.start_mode(mode)
            for i in range(cfg.requests):
                fault = cfg.inject_fault if (i == 0 and mode == cfg.modes()[0]) else None
                if not _one_request(
                    decode, router, prefill_address, decode_address, mode, i, stats, fault
                ):
                    break
                if progress is not None:
                    progress(mode, i + 1, cfg.requests)
            stats.integrity_checks = decode.log.verified
            stats.integrity_failures = decode.log.verify_failures
        router.send({"type": "shutdown", "grace": 5.0})
        shutdown_sent = True
        stats_msg = router.recv("final stats", timeout=30.0)
        decode.stop_core()
        result.prefill_blocks_held = int(stats_msg["blocks_held"])
        result.prefill_releases = int(stats_msg["releases"])
        result.control = {
            "hmac": True,
            "allowlist": [_HOST],
            "prefill_listener": stats_msg["listener"],
            "prefill_handshake": stats_msg["handshake"],
            "decode_listener": decode.listener_stats,
        }
        if result.prefill_blocks_held:
            result.errors.append(
                f"prefill still holds {result.prefill_blocks_held} blocks after every request "
                "finished (a release was lost)"
            )
        return result
    except MoriioError as exc:  # DemoError included
        if result is None:
            raise
        result.errors.append(f"{type(exc).__name__}: {exc}")
        return result
    finally:
        if not shutdown_sent:
            with contextlib.suppress(OSError, EOFError):
                parent_conn.send({"type": "shutdown", "grace": 0.0})
        _stop_worker(worker, grace=10.0)
        parent_conn.close()
        if isinstance(worker, threading.Thread):
            child_conn.close()
        if decode is not None:
            decode.close()


def _stop_worker(worker: BaseProcess | threading.Thread, grace: float) -> None:
    if not (worker.ident or getattr(worker, "pid", None)):
        return  # never started
    worker.join(grace)
    if isinstance(worker, threading.Thread):
        if worker.is_alive():
            logger.error("demo: prefill thread did not stop within %.0fs", grace)
        return
    if worker.is_alive():
        logger.warning("demo: prefill process %s did not exit; terminating it", worker.pid)
        worker.terminate()
        worker.join(5.0)
    if worker.is_alive():
        worker.kill()
        worker.join(5.0)


def _one_request(
    decode: _Decode,
    router: _Router,
    prefill_address: ctl.ZmqAddress,
    decode_address: ctl.ZmqAddress,
    mode: Mode,
    index: int,
    stats: ModeStats,
    fault: Fault | None,
) -> bool:
    """Run one request end to end; False when the run must stop (a transfer failed)."""
    cfg = decode.cfg
    bpr = cfg.blocks_per_request
    transfer_id = f"demo-{mode}-{index:05d}"
    # As vLLM's MoRIIO proxy does: both sides' control addresses ride in the request id.
    request_id = ctl.format_request_id(prefill_address, decode_address)
    router.send(
        {
            "type": "prefill",
            "request_id": request_id,
            "num_blocks": bpr,
            "kv_transfer_params": {"transfer_id": transfer_id, "do_remote_decode": True},
        }
    )
    reply = router.recv(f"prefill reply for transfer {transfer_id}")
    if reply.get("type") != "prefilled":
        stats.failures.append(str(reply.get("reason", reply)))
        return False
    params = ctl.parse_kv_transfer_params(reply["kv_transfer_params"])
    assert params.remote_block_ids is not None
    src = list(params.remote_block_ids[0])
    dst = [int(b) for b in decode.rng.choice(cfg.num_blocks or 0, bpr, replace=False)]
    expected_bytes = bpr * decode.cache.total_block_bytes()
    stats.requests += 1
    # What the vLLM connector's scheduler hands its worker: the core does the rest (handshake,
    # READ + release, or remote_blocks + waiting for write_done).
    task = RecvTask(
        req_id=request_id,
        transfer_id=transfer_id,
        peer=params.peer_address(request_id, is_producer=False),
        remote_engine_id=params.remote_engine_id,
        remote_dp_rank=params.remote_dp_rank,
        remote_tp_size=1,
        local_block_ids=tuple(dst),
        remote_block_ids=tuple(src) if mode == "read" else (),
        report_done=True,
        remote_incarnations=params.remote_incarnations,
        remote_hold_until_ms=params.remote_hold_until_ms,
    )
    if mode == "read":
        plan_s, runs = _plan_seconds(decode.templates, dst, src)
    else:
        plan_s, runs = _plan_seconds(decode.templates, src, dst)
    start = time.perf_counter()
    failure = decode.load(task)
    elapsed = time.perf_counter() - start
    if not failure and mode == "read":
        event = decode.log.events.get(transfer_id)
        if event is None or event.bytes != expected_bytes:
            moved = "no" if event is None else event.bytes
            failure = f"engine moved {moved} bytes, expected {expected_bytes}"
        else:
            runs = event.runs
    stats.runs += runs
    if failure:
        stats.failures.append(f"{mode} {transfer_id}: {failure}")
        return False
    stats.latencies_s.append(elapsed)
    stats.planning_s.append(plan_s)
    stats.bytes += expected_bytes
    if fault is not None:
        decode.inject(fault, dst)
    problems = decode.verify(transfer_id, dst)
    if problems:
        stats.mismatches.extend(problems[: max(0, _MAX_REPORTED - len(stats.mismatches))])
    else:
        stats.verified += 1
    return True


# ---- CLI --------------------------------------------------------------------------------------


def main(args: Any) -> int:
    """Run the demo from parsed CLI ``args``; returns the exit code (0 ok, 1 mismatch or
    failed transfer, 3 could not start)."""
    import json
    import sys

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cfg = DemoConfig(
        preset=args.preset,
        layers=args.layers,
        requests=args.requests,
        mode=args.mode,
        backend=args.backend,
        blocks_per_request=args.blocks_per_request,
        num_blocks=args.num_blocks,
        timeout=args.timeout,
        seed=args.seed,
        inject_fault=args.inject_fault,
        verify=args.verify,
    )
    # With --json stdout carries only the JSON; everything for humans goes to stderr.
    console = Console(stderr=args.json)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    tasks: dict[str, Any] = {}

    def on_start(result: DemoResult) -> None:
        _print_header(console, result)
        for mode in result.config.modes():
            tasks[mode] = progress.add_task(
                f"{mode.upper():5s} requests", total=result.config.requests
            )
        progress.start()

    def on_progress(mode: str, done: int, total: int) -> None:
        progress.update(tasks[mode], completed=done)

    console.print("starting the prefill and decode workers (building and registering KV caches)")
    try:
        try:
            result = run_demo(cfg, progress=on_progress, on_start=on_start)
        finally:
            progress.stop()
    except (InvalidArgumentError, DemoError, MoriioError) as exc:
        console.print(f"[red]demo could not run:[/red] {exc}")
        return EXIT_SETUP_FAILED
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow] (both workers were stopped)")
        return EXIT_INTERRUPTED
    if args.json:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
    _print_summary(console, result)
    return EXIT_OK if result.ok else EXIT_VERIFY_FAILED


def _print_header(console: Any, result: DemoResult) -> None:
    cfg = result.config
    preset = get_preset(cfg.preset)
    layers = cfg.layers or preset.num_layers
    console.print(
        f"[bold]moriio-native demo[/bold]  preset [cyan]{cfg.preset}[/cyan] "
        f"({layers} layers, {result.caches} caches, {_human(result.bytes_per_block)} per block"
        f"{', illustrative geometry' if preset.illustrative else ''})"
    )
    console.print(
        f"backend [cyan]{result.backend}[/cyan]: {result.backend_note}; "
        f"prefill pid {result.prefill_pid}, decode pid {result.decode_pid}"
    )
    console.print(
        f"{cfg.requests} requests per mode x {cfg.blocks_per_request} random blocks "
        f"({_human(cfg.blocks_per_request * result.bytes_per_block)} each), "
        f"{cfg.num_blocks} blocks per side; control plane: ZMQ on 127.0.0.1, HMAC-tagged"
    )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1000 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _print_summary(console: Any, result: DemoResult) -> None:
    from rich.table import Table

    table = Table(title="moriio-native demo summary")
    for column in (
        "mode",
        "requests",
        "bytes",
        "GB/s",
        "p50 ms",
        "p99 ms",
        "plan p50",
        "verified",
    ):
        table.add_column(column, justify="right" if column != "mode" else "left")
    for mode, stats in result.modes.items():
        d = stats.to_dict()
        ok = stats.verified == stats.requests == result.config.requests
        table.add_row(
            mode.upper(),
            str(stats.requests),
            _human(stats.bytes),
            f"{stats.gbps:.2f}",
            f"{d['latency_ms']['p50']:.2f}",
            f"{d['latency_ms']['p99']:.2f}",
            f"{d['planning_us']['p50']:.1f} µs",
            f"[green]{stats.verified}/{stats.requests}[/green]"
            if ok
            else f"[red]{stats.verified}/{stats.requests}[/red]",
        )
    console.print(table)
    if result.prefill_blocks_held is not None:
        held = result.prefill_blocks_held
        releases = (
            f" ({result.prefill_releases} READ releases received)" if "read" in result.modes else ""
        )
        console.print(f"prefill blocks still held at the end: {held}{releases}")
    problems = [p for s in result.modes.values() for p in s.failures + s.mismatches] + result.errors
    if result.ok:
        console.print(
            "[bold green]verification: passed[/bold green] -- every destination byte matched the "
            "prefill pattern and no byte outside the requested blocks changed"
        )
    else:
        console.print("[bold red]verification: FAILED[/bold red]")
        for line in problems[:_MAX_REPORTED]:
            console.print(f"  [red]-[/red] {line}")
        if result.backend == "ucx" and any(s.failures for s in result.modes.values()):
            console.print(
                "hint: UCX could not move host memory between the two processes here; see "
                "docs/troubleshooting.md (UCX transports, ptrace/CMA) or run with "
                "--backend loopback"
            )


__all__ = [
    "EXIT_OK",
    "EXIT_SETUP_FAILED",
    "EXIT_VERIFY_FAILED",
    "DemoConfig",
    "DemoError",
    "DemoResult",
    "KvPattern",
    "ModeStats",
    "main",
    "run_demo",
]
