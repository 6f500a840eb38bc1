"""A small prefill/decode proxy for MoRIIONativeConnector (and vLLM's MoRIIO protocol).

It speaks the protocol vLLM's MoRIIO proxy and vllm-router use, so either can replace it:

* service discovery: instances register by sending msgpack pings
  ``{"type": "P"|"D", "http_address", "zmq_address", "dp_size", "tp_size", "transfer_mode"}``
  to this proxy's ZMQ ROUTER port (``--discovery-host``:``--discovery-port``, default
  ``--host``:36367); every ping is schema-checked and a bad one is dropped (logged at most 20
  lines per 10 s). With a secret (``$MORIIO_NATIVE_AUTH_SECRET``, or the variable
  ``--auth-secret-env`` names, which must then be set) only pings signed with it are believed
  (HMAC-SHA256, fresh stamp, each stamp once: see ``moriio_native.control.security``); the
  instances need the same ``auth_secret`` and ``proxy_auth: true``. An instance silent for
  ``FORGET_AFTER_S`` is forgotten, and at most ``MAX_INSTANCES`` are held (pings of new
  addresses past it are dropped): pings at ever new addresses cannot grow the proxy;
* per request: the request id embeds both instances' control addresses
  (``___prefill_addr_{P}___decode_addr_{D}_{uuid}``), a fresh ``transfer_id`` goes to both legs;
  the prefill leg runs with ``max_tokens=1``; in READ mode the decode leg waits for the prefill's
  ``kv_transfer_params`` (block ids, engine id), in WRITE mode both legs start at once;
* the decode instance's answer is streamed back to the client.

Usage::

    python examples/launch/proxy.py --host 10.0.0.5 --port 10001 --discovery-port 36367

Both listeners bind ``--host`` only (default 127.0.0.1): set it to the address clients and
instances reach this host on; ``0.0.0.0`` binds every interface (logged as a warning when no
secret authenticates the registrations).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /health``,
``GET /instances``. Needs only what vLLM already installs (fastapi, uvicorn, aiohttp, pyzmq,
msgpack) plus moriio-native for the message schema.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moriio_native.control.addressing import format_request_id
from moriio_native.control.channel import RateLimitedWarnings
from moriio_native.control.messages import (
    MAX_PING_BYTES,
    InvalidMessageError,
    ProxyRegistration,
    decode,
)
from moriio_native.control.security import (
    DEFAULT_LISTENER_HANDSHAKE_MS,
    DEFAULT_LISTENER_HANDSHAKE_TIMEOUT,
    ENV_AUTH_SECRET,
    AuthenticationError,
    MessageAuth,
    RegistrationVerifier,
    listener_handshake_ms,
)
from moriio_native.errors import InvalidArgumentError

logger = logging.getLogger("moriio_native.proxy")

STALE_AFTER_S = 30.0  # an instance silent this long gets no requests
FORGET_AFTER_S = 600.0  # ... and this long is forgotten (/instances shows it stale until then)
MAX_INSTANCES = 1024


@dataclass
class Instance:
    registration: ProxyRegistration
    last_seen: float

    @property
    def url(self) -> str:
        host, port = self.registration.http_address.rsplit(":", 1)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address, as instances register it (unbracketed)
        return f"http://{host}:{port}"


class Registry:
    """Instances that pinged recently, at most MAX_INSTANCES. Thread-safe (one lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._instances: OrderedDict[str, Instance] = OrderedDict()  # least recently pinged first
        self._mode: str | None = None
        self._rr = itertools.count()
        # Without a secret anyone who reaches the port can ping: no log line per ping.
        self._other_mode = RateLimitedWarnings(logger, "registrations of another mode")
        self._full = RateLimitedWarnings(logger, "registrations past MAX_INSTANCES")
        self._new = RateLimitedWarnings(logger, "new registrations", level=logging.INFO)

    def update(self, reg: ProxyRegistration) -> None:
        now = time.monotonic()
        with self._lock:
            self._forget_silent(now)
            if self._mode is not None and reg.transfer_mode != self._mode:
                live = any(
                    now - i.last_seen < STALE_AFTER_S
                    for key, i in self._instances.items()
                    if key != reg.http_address
                )
                if not live:
                    # Every instance of the old mode stopped pinging: the deployment switched
                    # mode; the stale ones would hold the proxy to it for FORGET_AFTER_S.
                    self._instances.clear()
                    self._mode = None
            mode = self._mode = self._mode or reg.transfer_mode
            known = self._instances.pop(reg.http_address, None)
            full = known is None and len(self._instances) >= MAX_INSTANCES
            if reg.transfer_mode == mode and not full:
                self._instances[reg.http_address] = Instance(reg, now)
        if reg.transfer_mode != mode:
            self._other_mode.warn(
                "ignoring %s: it runs %s mode, the other instances %s",
                reg.http_address,
                reg.transfer_mode,
                mode,
            )
        elif full:
            self._full.warn(
                "ignoring %s: %d instances registered, the most this proxy holds",
                reg.http_address,
                MAX_INSTANCES,
            )
        elif known is None:
            self._new.warn("registered %s instance %s", reg.role, reg.http_address)

    def _forget_silent(self, now: float) -> None:
        """Forget instances silent for FORGET_AFTER_S (lock held); with none left, the next
        one sets the mode again."""
        while self._instances:
            oldest = next(iter(self._instances.values()))
            if now - oldest.last_seen < FORGET_AFTER_S:
                break
            self._instances.popitem(last=False)
        if not self._instances:
            self._mode = None

    def pick(self) -> tuple[Instance, Instance, str] | None:
        """A (prefill, decode) pair, round robin among live instances, and the mode."""
        now = time.monotonic()
        with self._lock:
            live = [i for i in self._instances.values() if now - i.last_seen < STALE_AFTER_S]
            prefills = [i for i in live if i.registration.role == "P"]
            decodes = [i for i in live if i.registration.role == "D"]
            if not prefills or not decodes or self._mode is None:
                return None
            n = next(self._rr)
            return prefills[n % len(prefills)], decodes[n % len(decodes)], self._mode

    def snapshot(self) -> list[dict[str, Any]]:
        """Every registration seen, with ``seconds_since_ping`` (stale after STALE_AFTER_S)."""
        now = time.monotonic()
        with self._lock:
            return [
                {**i.registration.to_wire(), "seconds_since_ping": round(now - i.last_seen, 1)}
                for i in self._instances.values()
            ]


def bind_discovery(
    host: str, port: int, verifier: RegistrationVerifier, handshake_ms: int
) -> zmq.Socket:
    """The registration listener on ``host:port``, bound (zmq.ZMQError when it cannot be)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_PING_BYTES)
    sock.setsockopt(zmq.HANDSHAKE_IVL, handshake_ms)  # a stalled handshake ends soon
    verifier.secure_listener(sock)  # with a secret: only pingers that hold it connect
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    shown = "*" if host in ("0.0.0.0", "*") else f"[{host}]" if ":" in host else host
    try:
        sock.bind(f"tcp://{shown}:{port}")
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


def discovery_loop(
    registry: Registry,
    host: str,
    port: int,
    stop: threading.Event,
    verifier: RegistrationVerifier | None = None,
    handshake_ms: int = DEFAULT_LISTENER_HANDSHAKE_MS,
    sock: zmq.Socket | None = None,
) -> None:
    """Receive registration pings on ``host:port`` (or on ``sock``, bound by
    :func:`bind_discovery`) until ``stop``; a ping that fails ``verifier`` (when given: signed,
    fresh, first use) or the schema is logged and dropped. A connection that has not finished
    ZMQ's handshake within ``handshake_ms`` is closed."""
    verifier = verifier if verifier is not None else RegistrationVerifier(MessageAuth(None))
    if sock is None:
        sock = bind_discovery(host, port, verifier, handshake_ms)
    # A stranger may send garbage in a loop: drops are logged at most 20 lines per 10 s, as the
    # instances' listeners log theirs. A bug one ping reaches must not end registration for
    # every instance: it is logged the same way, with its traceback.
    drops = RateLimitedWarnings(logger, "dropped registrations")
    errors = RateLimitedWarnings(logger, "errors handling registrations")
    try:
        while not stop.is_set():
            if not sock.poll(200):
                continue
            frames = sock.recv_multipart()
            try:
                payload = verifier.open(frames[1:])
                registry.update(decode(payload, (ProxyRegistration,), max_bytes=MAX_PING_BYTES))
            except (AuthenticationError, InvalidMessageError) as exc:
                drops.warn("dropped registration: %s", exc)
            except Exception as exc:
                errors.warn("dropped registration after an error: %r", exc, exc_info=exc)
    finally:
        sock.close(linger=0)


def _prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = params
    return out


def _log_write_prefill_failure(task: asyncio.Task[Any], url: str, tid: str) -> None:
    """A WRITE-mode prefill leg ended: its failure is logged at once, not when the decode leg
    ends (the decode waits abort_timeout for writes that never come, then recomputes)."""
    if task.cancelled() or task.exception() is None:
        return
    logger.warning(
        "prefill %s failed for transfer %s: %s; the decode recomputes the request after its "
        "abort_timeout",
        url,
        tid,
        task.exception(),
    )


def make_app(registry: Registry, timeout_s: float = 600.0) -> FastAPI:
    state: dict[str, aiohttp.ClientSession] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if "s" in state:
            await state.pop("s").close()

    app = FastAPI(lifespan=lifespan)

    async def session() -> aiohttp.ClientSession:
        if "s" not in state:
            # A connection per leg, closed after it (force_close): a pooled keep-alive
            # connection the instance closes when it has sat idle past the server's keep-alive
            # timeout (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default) can be reused in
            # the moment the server closes it, and that request then fails with "connection
            # reset" although the instance is fine. A new loopback or LAN connection costs far
            # less than the prefill or decode it carries.
            state["s"] = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                connector=aiohttp.TCPConnector(force_close=True),
            )
        return state["s"]

    @app.get("/health")
    async def health() -> Response:
        return Response("ok")

    @app.get("/instances")
    async def instances() -> JSONResponse:
        return JSONResponse(registry.snapshot())

    async def handle(request: Request, path: str) -> Response:
        picked = registry.pick()
        if picked is None:
            return JSONResponse(
                {"error": "no prefill or decode instance is registered"}, status_code=503
            )
        prefill, decode_inst, mode = picked
        body = await request.json()
        p_reg, d_reg = prefill.registration, decode_inst.registration
        request_id = format_request_id(p_reg.zmq_address, d_reg.zmq_address)
        tid = f"tx-{uuid.uuid4()}"
        http = await session()
        headers = {"X-Request-Id": request_id}
        p_params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_dp_size": d_reg.dp_size,
            "remote_tp_size": d_reg.tp_size,
            "transfer_id": tid,
        }

        async def run_prefill() -> dict[str, Any]:
            async with http.post(
                prefill.url + path, json=_prefill_body(body, p_params), headers=headers
            ) as resp:
                resp.raise_for_status()
                return await resp.json()

        d_params: dict[str, Any] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "transfer_id": tid,
            "remote_dp_size": p_reg.dp_size,
            "remote_tp_size": p_reg.tp_size,
            "remote_dp_rank": 0,
        }
        prefill_task: asyncio.Task[dict[str, Any]] | None = None
        try:
            if mode == "READ":
                answer = await run_prefill()
                returned = answer.get("kv_transfer_params") or {}
                # remote_incarnations: the prefill processes that computed the request; the
                # decode reads only from them. remote_hold_until_ms: until when they hold its
                # blocks; the decode reads only before then. remote_answer_tag: with
                # auth_secret set, the prefill's tag of its answer, without which the decode
                # does not act on it. remote_num_tokens, remote_prompt_digest: the
                # prompt positions the prefill computed and their digest; the decode loads
                # them only for the same prompt (docs/protocol.md, section 5).
                for key in (
                    "remote_engine_id",
                    "remote_block_ids",
                    "transfer_id",
                    "remote_incarnations",
                    "remote_hold_until_ms",
                    "remote_num_tokens",
                    "remote_prompt_digest",
                    "remote_answer_tag",
                ):
                    d_params[key] = returned.get(key)
            else:
                prefill_task = asyncio.create_task(run_prefill())
                prefill_task.add_done_callback(
                    lambda task: _log_write_prefill_failure(task, prefill.url, tid)
                )
        except aiohttp.ClientError as exc:
            logger.error("prefill %s failed: %s", prefill.url, exc)
            return JSONResponse({"error": f"prefill failed: {exc}"}, status_code=502)
        d_body = dict(body)
        d_body["kv_transfer_params"] = d_params
        resp = await http.post(decode_inst.url + path, json=d_body, headers=headers)
        if resp.status >= 400:
            logger.warning("decode %s answered HTTP %d", decode_inst.url, resp.status)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            finally:
                resp.release()
                if prefill_task is not None:
                    # The decode still answered; the failure was logged when it happened.
                    with contextlib.suppress(Exception):
                        await prefill_task

        return StreamingResponse(
            relay(),
            status_code=resp.status,
            media_type=resp.headers.get("Content-Type", "application/json"),
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions")

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the HTTP listener binds (0.0.0.0: every interface)",
    )
    parser.add_argument("--port", type=int, default=10001, help="HTTP port for clients")
    parser.add_argument(
        "--discovery-host", default=None, help="address the registration listener binds (--host)"
    )
    parser.add_argument("--discovery-port", type=int, default=36367, help="registration port")
    parser.add_argument(
        "--auth-secret-env",
        default=None,
        help="environment variable holding the shared secret registrations must be signed "
        f"with; when given it must be set (default: ${ENV_AUTH_SECRET}, if set)",
    )
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=DEFAULT_LISTENER_HANDSHAKE_TIMEOUT,
        help="seconds a registration connection gets to finish ZMQ's handshake before it is "
        "closed (the instances' listener_handshake_timeout)",
    )
    args = parser.parse_args(argv)
    for option, port in (("--port", args.port), ("--discovery-port", args.discovery_port)):
        if not 1 <= port <= 65535:
            parser.error(f"{option} must be 1..65535, got {port}")
    try:
        args.handshake_ms = listener_handshake_ms(args.handshake_timeout)
    except InvalidArgumentError as exc:
        parser.error(f"--handshake-timeout: {exc}")
    if args.discovery_host is None:
        args.discovery_host = args.host
    # Authentication asked for by name must not quietly fall back to believing every ping.
    if args.auth_secret_env is not None and not os.environ.get(args.auth_secret_env):
        parser.error(f"--auth-secret-env: ${args.auth_secret_env} is not set (or empty)")
    return args


def start_discovery(
    args: argparse.Namespace,
    registry: Registry,
    stop: threading.Event,
    verifier: RegistrationVerifier,
) -> threading.Thread:
    """The registration listener of ``args`` bound here, before its thread starts: a port it
    cannot bind stops the proxy (SystemExit naming it), rather than leaving it answering every
    request 503 with no way for an instance to register."""
    try:
        sock = bind_discovery(args.discovery_host, args.discovery_port, verifier, args.handshake_ms)
    except zmq.ZMQError as exc:
        raise SystemExit(
            f"proxy: cannot bind the registration port {args.discovery_host}:"
            f"{args.discovery_port}: {exc}"
        ) from None
    thread = threading.Thread(
        target=discovery_loop,
        args=(
            registry,
            args.discovery_host,
            args.discovery_port,
            stop,
            verifier,
            args.handshake_ms,
            sock,
        ),
        daemon=True,
    )
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    secret_env = args.auth_secret_env or ENV_AUTH_SECRET
    verifier = RegistrationVerifier(MessageAuth(os.environ.get(secret_env) or None))
    if not verifier.enabled and args.discovery_host in ("0.0.0.0", "*", "::"):
        logger.warning(
            "registrations on every interface are believed unsigned: anyone who reaches port "
            "%d can route requests; set $%s on the proxy and the instances",
            args.discovery_port,
            secret_env,
        )
    registry = Registry()
    stop = threading.Event()
    thread = start_discovery(args, registry, stop, verifier)
    try:
        uvicorn.run(make_app(registry), host=args.host, port=args.port, log_level="warning")
    finally:
        stop.set()
        thread.join(5)


if __name__ == "__main__":
    main()
