"""ZMQ sockets and threads of the control plane: listeners, the handshake client, the notify
sender and the proxy pinger.

Every listener is a ROUTER socket read by a :class:`_ListenerHub`: one background thread that
polls all the sockets attached to it. The listeners of a process share one hub (a handshake
server that answers checksum requests, whose answers can take long, gets its own), so a flood on
several ports wakes one thread, not one per port: every wake-up of a Python thread takes the GIL
from the connector's threads. A message that fails authentication or its schema is logged
(sender address and reason, rate limited) and dropped; the hub keeps running. While a listener
keeps dropping messages (a flood) the hub pauses its reads briefly after each burst
(:class:`_FloodGauge`), so that one wake-up reads many of its messages; the hub's other
listeners are read on meanwhile, and idle listeners or ones that drop nothing never pause.
``close()`` detaches the listener, closes its socket with linger 0 and waits for that within a
bounded time. Nothing here terminates the ZMQ context (by default the process-wide
``zmq.Context.instance()``), so several components -- and other libraries -- can share it.

Contents:

* :class:`NotifyListener` -- receives :data:`~.messages.NotifyMessage` s into a bounded queue;
  drops duplicates and messages of transfers marked terminal. ``drain``/``get``/
  ``mark_terminal``/``stats``/``close`` are thread-safe. When the queue is full (in messages
  or in payload bytes) the listener stops reading (ZMQ's own high-water marks then push back on
  senders) rather than dropping.
* :class:`HandshakeServer` -- answers handshake requests with the metadata a provider callable
  returns; learns the source address of every accepted requester into the allowlist. The
  provider runs on the hub's thread. ``close``/``stats`` are thread-safe.
* :func:`fetch_metadata` -- the handshake client: allowlist check, one request, bounded wait.
  Blocks the calling thread at most ``timeout`` seconds (in 100 ms slices, so Ctrl-C works).
* :class:`PolledRequests` -- requests to handshake servers (a decode's hold checks, through
  :func:`ask_checksums`) that one thread waits for, several outstanding on one kept connection
  per server, each answered through a callback by its deadline.
* :class:`NotifySender` -- sends notify messages; allowlist check before any socket; an LRU of
  DEALER sockets (one per peer endpoint). Thread-safe (one lock); never blocks on the network.
* :class:`ProxyPinger` -- a thread that sends a :class:`~.messages.ProxyRegistration` to the
  proxy every ``interval`` seconds (first one at once). ``start``/``stop`` are thread-safe.
* :func:`zmq_endpoint` -- ``tcp://host:port`` with IPv6 literals bracketed.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import select
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from moriio_native.errors import (
    FailedPreconditionError,
    IncompatiblePeerError,
    InvalidArgumentError,
    MoriioError,
    TransferTimeoutError,
    TransportError,
)
from moriio_native.pools import COMPUTING_EXIT_WAIT_S, DaemonPool

from .addressing import validate_host, validate_port
from .messages import (
    MAX_CHECKSUM_REQUEST_BYTES,
    MAX_HANDSHAKE_REQUEST_BYTES,
    MAX_HANDSHAKE_RESPONSE_BYTES,
    MAX_NOTIFY_BYTES,
    NOTIFY_TYPES,
    AbortWrite,
    ChecksumRequest,
    ChecksumResponse,
    HandshakeRejected,
    HandshakeRequest,
    HandshakeResponse,
    InvalidMessageError,
    NotifyMessage,
    ProtocolVersionError,
    ProxyRegistration,
    RemoteBlocks,
    decode,
    encode,
    now_ms,
    reason_text,
)
from .security import (
    AuthenticationError,
    ControlSecurity,
    FreshStamps,
    MessageAuth,
    PeerAllowlist,
)

logger = logging.getLogger("moriio_native.control.channel")

_POLL_MS = 100
# A proxy pinger whose every connection fails ZMQ's handshake (the proxy has another secret, or
# none) says so at once, then at most this often.
_PROXY_HANDSHAKE_WARN_EVERY_S = 60.0
# ... and, when ZMQ gave its connection up for good (a protocol failure), dials again this much
# later.
_PROXY_REDIAL_S = 1.0
# Numbers for the monitors' inproc addresses. pyzmq's default names a monitor after its socket's
# descriptor, which another thread's new socket may take over while ZMQ still closes the
# previous monitor's endpoint in the background. next() is atomic under the GIL.
_MONITOR_IDS = itertools.count()
# Messages a listener reads per wake-up before it looks at its stop flag and polls again.
_BURST = 256
_MAX_TAG_FRAME = 64
# A notify listener wakes its consumers after this many deliveries at most, even mid-burst.
_WAKE_EVERY = 32
# A flooded listener's pause after a burst: the hub reads its socket again this much later (the
# others meanwhile), waiting with the GIL released when no other listener has work. Each
# wake-up of the reading thread costs the process far more than reading one more queued message
# (it takes the GIL from the connector's threads), so under a flood it lets messages pile up and
# reads them in one go. The price: a genuine message that arrives meanwhile on the flooded port
# waits up to this long -- most of what a flood slowed genuine requests by. 0.5 ms keeps genuine
# rounds within 1.06-1.08x (p50) of a quiet instance's under a 6,000/s flood of every port,
# against 1.16-1.20x with 2 ms, for more CPU per flood message (docs/reliability.md, Flood).
_FLOOD_PAUSE_S = 0.0005
# select.select() refuses descriptors from FD_SETSIZE on (Linux: 1024).
_SELECT_FD_LIMIT = 1024
# Flooded: at least _FLOOD_DROPS messages dropped in the current or the previous window of
# _FLOOD_WINDOW_S (a stray bad message now and then does not make a listener pause).
_FLOOD_DROPS = 8
_FLOOD_WINDOW_S = 0.1
# Payload bytes a notify listener's queue may hold: past them it stops reading until its
# consumers drain (the backpressure of its count bound; the senders' ZMQ queues then fill). The
# count bound alone (65,536 messages of up to MAX_NOTIFY_BYTES) would let a stalled consumer's
# queue hold 512 GiB. Two messages of the largest size fit, or about 400 announcements of a
# 128k-token prompt (8,192 block ids, up to 40 KB): a consumer that keeps up never meets it.
# Decoded, a message takes up to about 12 times its bytes (a block id of 3 bytes is an int of
# 28 and a pointer), so the queue holds at most about 300 MB.
MAX_PENDING_NOTIFY_BYTES = 16 << 20
# Messages ZMQ itself takes off one connection into a notify listener's socket before it stops
# reading that connection (its receive high-water mark; ZMQ's default is 1000). While the
# listener holds back (its queue at a bound) those wait in the process's memory, each up to
# MAXMSGSIZE: with the default, 1000 x 16 MiB per sender, whatever max_pending_bytes says.
_NOTIFY_RCVHWM = 8


def zmq_endpoint(host: str, port: int) -> str:
    """``tcp://host:port`` for a validated host (IPv6 literals in brackets) and port."""
    host = validate_host(host)
    port = validate_port(port)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


_C = TypeVar("_C", bound="_ClosesOnExit")
_M = TypeVar("_M")


class _ClosesOnExit:
    """``with`` support: the block's end calls the subclass's ``close()``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RateLimitedWarnings:
    """Warnings through ``log``, at most ``burst`` lines per ``window_s``: a flood of bad or
    stray messages must not flood the log too (a line per message would itself cost the
    instance more than rejecting the message). Past the burst, warnings are counted, and the
    count is logged (one line) with the first warning of a later window. Thread-safe."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        burst: int = 20,
        window_s: float = 10.0,
        level: int = logging.WARNING,
    ) -> None:
        """``level``: the lines' level (an INFO line a stranger can cause is limited too)."""
        if burst < 1 or not window_s > 0:
            raise InvalidArgumentError("a warning rate limit needs burst >= 1 and window_s > 0")
        self._log = log
        self._level = level
        self._what = what
        self._burst = burst
        self._window_s = window_s
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._in_window = 0
        self._suppressed = 0

    @property
    def suppressed(self) -> int:
        """Warnings not logged in the current window so far."""
        with self._lock:
            return self._suppressed

    def allows(self) -> bool:
        """Whether the next :meth:`warn` would be logged (so its text is worth building)."""
        with self._lock:
            return self._in_window < self._burst or self._window_over(time.monotonic())

    def _window_over(self, now: float) -> bool:
        return now - self._window_start >= self._window_s

    def warn(self, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        """``log.warning(msg, *args)`` (at the limit's level) unless this window's burst is
        spent (then counted); ``exc_info``: an exception whose traceback the line carries (an
        unexpected error)."""
        now = time.monotonic()
        with self._lock:
            suppressed, span = 0, 0.0
            if self._window_over(now):
                suppressed, span = self._suppressed, now - self._window_start
                self._window_start, self._in_window, self._suppressed = now, 0, 0
            logged = self._in_window < self._burst
            if logged:
                self._in_window += 1
            else:
                self._suppressed += 1
        # Logged outside the lock: a handler may be slow.
        if suppressed:
            self._log.log(
                self._level,
                "%s: %d more like this in the last %.0f s were not logged",
                self._what,
                suppressed,
                span,
                stacklevel=2,
            )
        if logged:
            # The caller's line, not this one.
            self._log.log(self._level, msg, *args, exc_info=exc_info, stacklevel=2)


class _DropLog:
    """Logs dropped messages of one listener, rate limited (:class:`RateLimitedWarnings`)."""

    def __init__(self, component: str) -> None:
        self._component = component
        self._limit = RateLimitedWarnings(logger, f"{component}: dropped messages")

    def detailed(self) -> bool:
        """Whether the next drop is logged: only then is its reason worth explaining."""
        return self._limit.allows()

    def drop(self, peer: _Sender, reason: str, exc_info: BaseException | None = None) -> None:
        """Log the drop unless the rate limit is spent; ``exc_info``: the unexpected error
        that dropped it (its traceback is logged with the line)."""
        self._limit.warn(
            "%s: dropped message from %s: %s",
            self._component,
            peer,
            reason,
            exc_info=exc_info,
        )


class _Sender:
    """The sender of one received message, looked up only when needed: its IP when a
    handshake is accepted, its description when a log line shows it (most dropped messages
    are counted, not logged)."""

    __slots__ = ("_frames",)

    def __init__(self, frames: list[zmq.Frame]) -> None:
        self._frames = frames

    @property
    def ip(self) -> str | None:
        """The sender's IP, ``None`` if ZMQ does not know it."""
        try:
            ip: str | None = self._frames[-1].get("Peer-Address")
        except (zmq.ZMQError, AttributeError, KeyError):
            ip = None
        return ip

    def __str__(self) -> str:
        ident = self._frames[0].bytes.hex() if self._frames else "?"
        return f"{self.ip or 'unknown address'} (identity {ident[:16]})"


class _FloodGauge:
    """Whether a listener is flooded: at least ``_FLOOD_DROPS`` messages dropped in the current
    or the previous ``_FLOOD_WINDOW_S`` window. Used by the listener thread only (no lock)."""

    __slots__ = ("_current", "_previous", "_window_start")

    def __init__(self) -> None:
        self._previous = 0
        self._current = 0
        self._window_start = time.monotonic()

    def _roll(self, now: float) -> None:
        elapsed = now - self._window_start
        if elapsed >= _FLOOD_WINDOW_S:
            # An idle gap longer than a window forgets the drops before it.
            self._previous = self._current if elapsed < 2 * _FLOOD_WINDOW_S else 0
            self._current = 0
            self._window_start = now

    def dropped(self) -> None:
        self._current += 1

    def flooded(self) -> bool:
        self._roll(time.monotonic())
        return max(self._previous, self._current) >= _FLOOD_DROPS


class _ListenerHub:
    """One thread that reads the sockets of every listener attached to it.

    The thread polls the attached sockets (and a pipe that wakes it for attach and detach);
    for each socket with messages it reads a burst through its listener. It owns the sockets
    while they are attached: a ZMQ socket is used by one thread at a time. It starts with the
    first listener attached and ends when the last one is detached; a thread that died (a
    handler raised ``SystemExit``) is replaced by one that reads on. A private hub (one
    listener's own) closes its wake pipe when its thread ends. In a forked child a hub starts
    afresh (its own lock, pipe and thread; the parent's sockets are not touched). Thread-safe.
    """

    def __init__(self, name: str, *, private: bool = False) -> None:
        self._name = name
        self._private = private
        self._start_afresh()

    def _start_afresh(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        # Both used by the thread only (commands pass through _commands, under the lock).
        self._attached: dict[zmq.Socket, _RouterListener] = {}
        self._commands: deque[tuple[_RouterListener, threading.Event | None]] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False  # the pipe closed (a private hub whose thread ended)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    def _check_fork(self) -> None:
        """In a forked child: nothing reads there, and the parent's sockets, thread and pipe
        (through which each process would read the other's wake-ups) are not the child's."""
        if self._pid != os.getpid():
            self._start_afresh()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread reading the listeners now (None while none is attached)."""
        return self._thread

    def attach(self, listener: _RouterListener) -> None:
        """Start reading ``listener`` (its socket then belongs to the hub's thread). Raises
        RuntimeError when no thread can be started (nothing attached then)."""
        self._command(listener, None)

    def detach(self, listener: _RouterListener, timeout: float) -> bool:
        """Stop reading ``listener`` and release its socket (unbound and closed); whether that
        happened within ``timeout`` seconds."""
        if threading.current_thread() is self._thread:
            listener._release()  # a listener closed from a handler: the socket is ours here
            return True
        done = threading.Event()
        self._command(listener, done)
        return done.wait(timeout)

    def _command(self, listener: _RouterListener, done: threading.Event | None) -> None:
        self._check_fork()
        with self._lock:
            if self._closed:  # a private hub after its one listener was detached
                if done is not None:
                    done.set()
                return
            self._commands.append((listener, done))
            try:
                self._start_thread()
            except BaseException:
                self._commands.pop()
                raise
            self._wake_locked()

    def _start_thread(self) -> None:
        """Start the thread if none runs (the lock held)."""
        if self._thread is None:
            thread = threading.Thread(target=self._run, name=f"moriio-{self._name}", daemon=True)
            thread.start()
            self._thread = thread

    def wake(self) -> None:
        """Make the thread look at its commands and its listeners' readiness now."""
        self._check_fork()
        with self._lock:
            if not self._closed:
                self._wake_locked()

    def _wake_locked(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: the thread has wake-ups to read
            os.write(self._wake_write, b"\0")

    def _apply_commands(self) -> bool:
        """Attach and detach what was asked; whether the thread goes on (False: nothing is
        attached nor asked, and the thread is forgotten so that the next attach starts one)."""
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        for listener, done in commands:
            if done is None:
                self._attached[listener.socket] = listener
            else:
                self._attached.pop(listener.socket, None)
                listener._release()
                done.set()
        with self._lock:
            if self._attached or self._commands:
                return True
            self._thread = None
            if self._private:
                self._closed = True
                os.close(self._wake_read)
                os.close(self._wake_write)
            return False

    def _run(self) -> None:
        try:
            while self._apply_commands():
                try:
                    self._read_round()
                except Exception:  # the hub must survive anything: its listeners depend on it
                    logger.exception("%s: error in a round of reads", self._name)
                    time.sleep(_POLL_MS / 1000)
        finally:
            with self._lock:
                if self._thread is threading.current_thread():
                    # Ended by what no round survives (SystemExit from a handler): another
                    # thread reads on.
                    logger.error("%s: the reading thread ended; starting another", self._name)
                    self._thread = None
                    self._start_thread()

    def _read_round(self) -> None:
        """Send the replies answered on other threads since the last round, poll the attached
        sockets whose listeners may read (neither paused after a flooded burst nor held back
        by their consumers), read a burst from each that has messages, and pause each of those
        that is flooded. While every listener with work pauses, wait for the first pause to end
        (or for a command or a reply: both wake the thread, and the round after sends it)."""
        for listener in self._attached.values():
            if not listener._detached:
                listener._send_replies()
        now = time.monotonic()
        readable: list[zmq.Socket] = []
        resume = math.inf  # when the first paused listener reads again
        for sock, listener in list(self._attached.items()):
            if listener._detached:  # released by a handler on this thread (detach)
                del self._attached[sock]
            elif listener._paused_until > now:
                resume = min(resume, listener._paused_until)
            elif listener._ready():
                readable.append(sock)
        if not readable and resume < math.inf:
            self._pause(min(resume - now, _POLL_MS / 1000))
            return
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        for sock in readable:
            poller.register(sock, zmq.POLLIN)
        timeout = _POLL_MS
        if resume < math.inf:  # a paused listener reads again within it
            timeout = min(timeout, max(1, math.ceil((resume - now) * 1000)))
        try:
            events = dict(poller.poll(timeout))
        except zmq.ZMQError as exc:
            self._release_failed(exc)
            return
        if self._wake_read in events:
            self._drain_wake_pipe()
        flooded = []
        for sock, listener in list(self._attached.items()):
            if sock not in events or listener._detached:
                continue
            if not listener._read_burst():
                del self._attached[sock]
                listener._release()
                continue
            listener._burst_done()
            if listener._flooded():
                flooded.append(listener)
        # One end for the round's pauses: listeners flooded together are read again together,
        # in one wake-up, not one each.
        until = time.monotonic() + _FLOOD_PAUSE_S
        for listener in flooded:
            listener._paused_until = until

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` with the GIL released, or until the wake pipe has a command (a
        close is not held up by a pause). ``select`` on the pipe alone: it costs a pause about
        what a sleep does (a ZMQ poll that times out costs twice that). ``select`` only below
        FD_SETSIZE: the pipe of a hub made in a process that holds 1024 descriptors is past
        it, which select() refuses (ValueError every pause); ``poll`` takes any descriptor, in
        whole milliseconds."""
        if self._wake_read < _SELECT_FD_LIMIT:
            woken = bool(select.select([self._wake_read], [], [], seconds)[0])
        else:
            waiter = select.poll()
            waiter.register(self._wake_read, select.POLLIN)
            woken = bool(waiter.poll(max(1, math.ceil(seconds * 1000))))
        if woken:
            self._drain_wake_pipe()

    def _drain_wake_pipe(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_read, 4096)

    def _release_failed(self, exc: zmq.ZMQError) -> None:
        """After a failed poll: release the sockets that fail on their own (their context was
        terminated, say), so that the others are read on."""
        for sock, listener in list(self._attached.items()):
            try:
                sock.getsockopt(zmq.EVENTS)
            except zmq.ZMQError as failed:
                logger.error("%s on port %d stopped: %s", listener._name, listener.port, failed)
                del self._attached[sock]
                listener._release()
        logger.debug("%s: poll failed: %s", self._name, exc)


# The hub of every listener of the process but checksum-answering handshake servers (and
# those made with own_thread).
_SHARED_HUB = _ListenerHub("listeners")


class _RouterListener(_ClosesOnExit):
    """A bound ROUTER socket read by a :class:`_ListenerHub`. Subclasses implement ``_handle``."""

    _name = "router"
    _extra_stats: tuple[str, ...] = ()
    # The socket's receive high-water mark (None: ZMQ's default).
    _rcvhwm: int | None = None
    # The socket's send high-water mark per connection (None: ZMQ's default, 1000).
    _sndhwm: int | None = None
    _security: ControlSecurity  # set by each subclass before it attaches to its hub

    def __init__(
        self,
        port: int,
        *,
        bind_host: str,
        max_message_bytes: int,
        context: zmq.Context | None,
        own_thread: bool,
    ) -> None:
        if port != 0:
            port = validate_port(port, what=f"{self._name} port")
        self._context = context if context is not None else zmq.Context.instance()
        self._max_message_bytes = max_message_bytes
        self._stop = threading.Event()
        self._state_lock = threading.Lock()
        self._stats: dict[str, int] = dict.fromkeys(
            ("received", "dropped_malformed", "dropped_auth", *self._extra_stats, "flood_pauses"),
            0,
        )
        self._drops = _DropLog(self._name)
        self._flood = _FloodGauge()
        # Set by the hub's thread after a flooded burst: it reads this socket again from then on
        # (time.monotonic()).
        self._paused_until = 0.0
        host = "*" if bind_host == "*" else validate_host(bind_host, what="bind host")
        sock = self._context.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # Transport-level cap: ZMQ disconnects a peer that sends more. The application
            # check below is tighter, so ordinary oversize messages are logged, not silent.
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes + 4096)
            if self._rcvhwm is not None:
                sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
            if self._sndhwm is not None:
                sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            self._security.limit_handshakes(sock)
            ipv6 = ":" in host
            if ipv6:  # before the accept filters: ZMQ parses each in the socket's family
                sock.setsockopt(zmq.IPV6, 1)
            # accept_only_allowed_peers: ZMQ closes a connection from elsewhere as it accepts
            # it, so a stranger's messages cost this process no read at all.
            for network in self._security.allowlist.accept_filters(ipv6=ipv6):
                sock.setsockopt_string(zmq.TCP_ACCEPT_FILTER, network)
            # With a secret, a peer without it fails ZMQ's CURVE handshake: none of its frames
            # is queued or read (security.py).
            self._security.auth.secure_listener(sock)
            shown = f"[{host}]" if ipv6 else host
            endpoint = f"tcp://{shown}:{port if port else '*'}"
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                raise TransportError(f"{self._name}: cannot bind {endpoint}: {exc}") from exc
            self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._port = int(self._endpoint.rsplit(":", 1)[1])
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock = sock
        self._hub = _ListenerHub(self._name, private=True) if own_thread else _SHARED_HUB
        self._pid = os.getpid()
        self._detached = False
        try:
            self._hub.attach(self)
        except BaseException:
            self._detached = True
            sock.close(linger=0)
            raise
        logger.info("%s listening on port %d", self._name, self._port)

    @property
    def socket(self) -> zmq.Socket:
        """The bound socket (used by the hub's thread only while attached)."""
        return self._sock

    @property
    def reader(self) -> threading.Thread | None:
        """The thread that reads this listener now: its hub's (the process's, shared with its
        other listeners, or with ``own_thread`` its own)."""
        return self._hub.thread

    @property
    def port(self) -> int:
        """The bound port (the chosen one when constructed with port 0)."""
        return self._port

    def stats(self) -> dict[str, int]:
        """A snapshot of the counters: ``received`` (messages read off the socket),
        ``dropped_malformed`` (framing, size or schema), ``dropped_auth`` (missing or bad tag);
        the notify listener adds ``delivered`` (queued for drain/get, less those later
        dropped because their transfer ended), ``dropped_duplicate`` and ``dropped_late``;
        the handshake server ``answered`` and ``rejected``; and ``flood_pauses``: how often
        the listener paused after a burst because it was dropping many messages. Thread-safe."""
        with self._state_lock:
            return dict(self._stats)

    def _count(self, key: str) -> None:
        """Count one outcome (on the listener thread, or a handshake server's answering pool;
        every ``dropped_*`` feeds the gauge)."""
        with self._state_lock:
            self._stats[key] = self._stats.get(key, 0) + 1
        if key.startswith("dropped"):
            self._flood.dropped()

    def _drop(
        self, key: str, peer: _Sender, reason: str, exc_info: BaseException | None = None
    ) -> None:
        self._count(key)
        self._drops.drop(peer, reason, exc_info)

    def _ready(self) -> bool:
        """Whether the hub may read another message of this listener now (subclasses hold
        back while their consumers lag). Never blocks: the hub reads other listeners too."""
        return True

    def _open(
        self, body: list[bytes], peer: _Sender, accept: tuple[type[_M], ...], max_bytes: int
    ) -> _M | None:
        """The authenticated, schema-checked message in ``body``; None (counted and logged as
        a drop) when the tag or the message is bad."""
        try:
            payload = self._security.auth.open(body)
        except AuthenticationError as exc:
            self._drop("dropped_auth", peer, str(exc))
            return None
        try:
            return decode(payload, accept, max_bytes=max_bytes, explain=False)
        except ProtocolVersionError:
            raise  # answerable: the handshake server refuses it by name
        except InvalidMessageError as exc:
            reason = str(exc)
        if self._drops.detailed():
            # Explained only for a drop that is logged (the second parse that names the type
            # and the field): asking the rate limit first would cost every message, valid or
            # not, a lock; the same input fails again.
            try:
                decode(payload, accept, max_bytes=max_bytes)
            except InvalidMessageError as exc:
                reason = str(exc)
        self._drop("dropped_malformed", peer, reason)
        return None

    def _handle(self, sock: zmq.Socket, identity: bytes, body: list[bytes], peer: _Sender) -> None:
        raise NotImplementedError

    def _burst_done(self) -> None:
        """Called after each burst (subclasses wake their consumers here)."""

    def _send_replies(self) -> None:
        """Send the replies answered on other threads, and answer the requests that became
        answerable since (subclasses that answer so; on the hub's thread, the socket's one
        user, at the start of each round)."""

    def _flooded(self) -> bool:
        """Whether this listener keeps dropping messages (its hub then pauses its reads;
        counted)."""
        if not self._flood.flooded():
            return False
        self._count("flood_pauses")
        return True

    def _read_burst(self) -> bool:
        """Handle what is queued, up to ``_BURST`` messages, without polling in between: a
        poll per message would cost a flood of small messages more than rejecting them.
        False when the socket failed (logged; the hub then releases it)."""
        sock = self._sock
        for _ in range(_BURST):
            try:
                frames = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return True
            except zmq.ZMQError as exc:
                logger.error("%s on port %d stopped: %s", self._name, self._port, exc)
                return False
            self._count("received")
            peer = _Sender(frames)
            try:
                self._dispatch(sock, frames, peer)
            except Exception as exc:  # the listener must survive anything one message does
                # Through the drop log's rate limit: whoever found a message that reaches a bug
                # can send it in a loop, and a traceback per message would flood the log.
                self._drop("dropped_malformed", peer, f"error handling it: {exc!r}", exc)
            if self._stop.is_set() or not self._ready():
                return True
        return True

    def _release(self) -> None:
        """Unbind and close the socket, once (on the hub's thread)."""
        if self._detached:
            return
        self._detached = True
        sock = self._sock
        # ZMQ closes a listening socket asynchronously in its I/O thread. Wait (bounded) for
        # the CLOSED event so the port is really free when close() returns and a restarted
        # listener can bind it again at once. The hub's other listeners wait meanwhile (ZMQ
        # takes milliseconds; at most a second): a listener closes at shutdown, not per request.
        try:
            address = f"inproc://moriio-native.listener-close.{next(_MONITOR_IDS)}"
            monitor = sock.get_monitor_socket(zmq.EVENT_CLOSED, address)
            try:
                sock.unbind(self._endpoint)
                if monitor.poll(1000):
                    monitor.recv_multipart()
            finally:
                sock.disable_monitor()
                monitor.close(linger=0)
        except zmq.ZMQError as exc:
            logger.debug("%s on port %d: unbind: %s", self._name, self._port, exc)
        sock.close(linger=0)

    def _dispatch(self, sock: zmq.Socket, frames: list[zmq.Frame], peer: _Sender) -> None:
        identity, rest = frames[0].bytes, frames[1:]
        if not 1 <= len(rest) <= 2:
            self._drop("dropped_malformed", peer, f"{len(rest)} frames, expected 1 or 2")
            return
        if len(rest[0]) > self._max_message_bytes:
            reason = f"{len(rest[0])} bytes, more than {self._max_message_bytes}"
            self._drop("dropped_malformed", peer, reason)
            return
        if len(rest) == 2 and len(rest[1]) > _MAX_TAG_FRAME:
            self._drop("dropped_malformed", peer, "oversized second frame")
            return
        self._handle(sock, identity, [f.bytes for f in rest], peer)

    def close(self, timeout: float = 5.0) -> None:
        """Detach from the hub and close the socket; waits at most ``timeout`` seconds (the hub
        notices within a round of reads). Idempotent; thread-safe. In a forked child the socket
        is the parent's: it is left alone."""
        with self._state_lock:
            if self._stop.is_set():
                return
            self._stop.set()
        if self._pid != os.getpid():
            self._detached = True
            return
        if not self._hub.detach(self, timeout):
            logger.error("%s on port %d did not stop within %.1fs", self._name, self._port, timeout)


class NotifyListener(_RouterListener):
    """Receives notify messages on ``port`` and queues them for :meth:`drain`/:meth:`get`.

    Delivery promise: each distinct notification is delivered at most once -- a copy with the
    same ``dedup_key`` (same type and transfer, and same writer/consumer rank where the
    message has one) is dropped -- and nothing is delivered for a transfer after
    :meth:`mark_terminal` (also not what was still queued) but ``abort_write`` and
    ``remote_blocks``, which still need their answers. Both memories are bounded LRUs.
    """

    _name = "notify listener"
    _extra_stats = ("delivered", "dropped_duplicate", "dropped_late")
    _rcvhwm = _NOTIFY_RCVHWM

    def __init__(
        self,
        port: int,
        security: ControlSecurity,
        *,
        bind_host: str = "*",
        max_pending: int = 65536,
        max_pending_bytes: int = MAX_PENDING_NOTIFY_BYTES,
        dedup_capacity: int = 65536,
        terminal_capacity: int = 65536,
        max_message_bytes: int = MAX_NOTIFY_BYTES,
        context: zmq.Context | None = None,
        own_thread: bool = False,
    ) -> None:
        """Binds ``bind_host:port`` (``port=0``: any free port, see :attr:`port`) and has it
        read by the process's listener thread (``own_thread``: by a thread of its own, as a
        listener of another process would be: for tests and benchmarks that stand in for other
        processes). Raises TransportError when the port cannot be bound. The listener stops
        reading while ``max_pending`` messages, or more than ``max_pending_bytes`` of their
        payloads, wait for drain/get."""
        bounds = (max_pending, max_pending_bytes, dedup_capacity, terminal_capacity)
        if min(*bounds, max_message_bytes) < 1:
            raise InvalidArgumentError("notify listener bounds must be positive")
        self._security = security
        self._cond = threading.Condition()
        # Each with its payload's size, which _pending_bytes sums.
        self._pending: deque[tuple[NotifyMessage, int]] = deque()
        self._max_pending = max_pending
        self._pending_bytes = 0
        self._max_pending_bytes = max_pending_bytes
        self._seen: OrderedDict[tuple[str, ...], None] = OrderedDict()
        self._seen_capacity = dedup_capacity
        self._terminal: OrderedDict[str, None] = OrderedDict()
        self._terminal_capacity = terminal_capacity
        self._unannounced = 0  # deliveries since consumers were last woken (hub thread)
        self._held_back = False  # the hub stopped reading for want of room (the condition held)
        super().__init__(
            port,
            bind_host=bind_host,
            max_message_bytes=max_message_bytes,
            context=context,
            own_thread=own_thread,
        )

    def stats(self) -> dict[str, int]:
        """The counters of :meth:`_RouterListener.stats` plus three gauges: ``queued`` (messages
        waiting for drain/get, at most ``max_pending``), ``queued_bytes`` (their payloads'
        bytes: at most ``max_pending_bytes`` and one message more) and ``remembered``
        (deduplication keys held, at most ``dedup_capacity``). Thread-safe."""
        out = super().stats()
        with self._cond:
            out["queued"] = len(self._pending)
            out["queued_bytes"] = self._pending_bytes
            out["remembered"] = len(self._seen)
        return out

    def _has_room(self) -> bool:
        """Whether the queue takes another message (the condition held)."""
        return (
            len(self._pending) < self._max_pending
            and self._pending_bytes <= self._max_pending_bytes
        )

    def _half_empty(self) -> bool:
        """Whether the queue holds at most half its bounds (the condition held): where a
        held-back listener is read again. Waking the hub as soon as one message fits would cost
        a round of reads per message while consumers lag."""
        return (
            len(self._pending) <= self._max_pending // 2
            and self._pending_bytes <= self._max_pending_bytes // 2
        )

    def _ready(self) -> bool:
        with self._cond:
            if self._has_room():
                return True
            self._held_back = True  # the consumer that makes room wakes the hub (_pop)
            self._wake_consumers()  # they make the room the hub waits for
            return False

    def _wake_consumers(self) -> None:
        """Wake the threads waiting in get (the condition held). Once per burst or per
        ``_WAKE_EVERY`` deliveries, not per message: a wake-up per flood message cost the
        process more than the message itself."""
        if self._unannounced:
            self._unannounced = 0
            self._cond.notify_all()

    def _burst_done(self) -> None:
        with self._cond:
            self._wake_consumers()

    def _handle(self, sock: zmq.Socket, identity: bytes, body: list[bytes], peer: _Sender) -> None:
        message = self._open(body, peer, NOTIFY_TYPES, self._max_message_bytes)
        if message is None:
            return
        with self._cond:
            if self._late(message):
                outcome = "dropped_late"
            elif message.dedup_key in self._seen:
                outcome = "dropped_duplicate"
            else:
                outcome = "delivered"
                self._seen[message.dedup_key] = None
                if len(self._seen) > self._seen_capacity:
                    self._seen.popitem(last=False)
                self._pending.append((message, len(body[0])))
                self._pending_bytes += len(body[0])
                self._unannounced += 1
            # Counted before waking consumers, so a consumer that got the message also sees it
            # in stats().
            self._count(outcome)
            if self._unannounced >= _WAKE_EVERY:
                self._wake_consumers()
        if outcome != "delivered":
            logger.debug("notify listener: %s %s from %s", outcome, message, peer)

    def drain(self, max_items: int | None = None) -> list[NotifyMessage]:
        """All queued messages (at most ``max_items``), oldest first, without waiting."""
        out: list[NotifyMessage] = []
        late = 0
        with self._cond:
            while self._pending and (max_items is None or len(out) < max_items):
                message = self._pop()
                if self._late(message):
                    late += 1
                else:
                    out.append(message)
            self._cond.notify_all()
        if late:
            with self._state_lock:
                self._stats["delivered"] -= late
                self._stats["dropped_late"] += late
        return out

    def get(self, timeout: float) -> NotifyMessage | None:
        """The oldest queued message, waiting up to ``timeout`` seconds; ``None`` on timeout."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                while self._pending:
                    message = self._pop()
                    self._cond.notify_all()
                    if not self._late(message):
                        return message
                    with self._state_lock:
                        self._stats["delivered"] -= 1
                        self._stats["dropped_late"] += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(min(remaining, _POLL_MS / 1000))

    def _pop(self) -> NotifyMessage:
        """The oldest queued message, out of the queue (the condition held)."""
        message, size = self._pending.popleft()
        self._pending_bytes -= size
        if self._held_back and self._half_empty():
            self._held_back = False
            self._hub.wake()
        return message

    def _late(self, message: NotifyMessage) -> bool:
        """Whether ``message`` is for a terminal transfer and dropped. An ``abort_write`` or a
        ``remote_blocks`` is never late: the decode rank waits for its answer even when the
        writer ended already (``write_aborted``; ``write_failed`` for a job that ended before
        the rank announced)."""
        return message.transfer_id in self._terminal and not isinstance(
            message, (AbortWrite, RemoteBlocks)
        )

    def mark_terminal(self, transfer_id: str) -> None:
        """From now on drop every message of ``transfer_id`` (it is done/failed/aborted)."""
        with self._cond:
            self._terminal[transfer_id] = None
            self._terminal.move_to_end(transfer_id)
            if len(self._terminal) > self._terminal_capacity:
                self._terminal.popitem(last=False)


MetadataProvider = Callable[[HandshakeRequest], HandshakeResponse]
ChecksumProvider = Callable[[ChecksumRequest], ChecksumResponse]
#: An answer the reading thread may give without waiting, or None (HandshakeServer).
ChecksumAtOnce = Callable[[ChecksumRequest], ChecksumResponse | None]
#: Calls its second argument once the request is worth answering, on whichever thread learns
#: it; never blocks (HandshakeServer).
ChecksumReadiness = Callable[[ChecksumRequest, Callable[[], None]], None]

#: Requests a :class:`PolledRequests` has outstanding at once on one server (the others wait
#: for their turn, their deadlines running): a decode rank's checks then wait on a prefill rank
#: as many at a time as when 8 threads each made one, so the prefill's bound on the checks it
#: keeps waiting (MAX_PENDING_CHECKSUM_ANSWERS) holds for as many decode ranks as before.
MAX_OUTSTANDING_PER_SERVER = 8

#: Threads that compute a handshake server's checksum answers (reading blocks; a hold check
#: left to them is a lookup), and how many requests may wait or be answered at once before
#: more are rejected: a decode rank has at most 8 checks outstanding on one prefill rank
#: (MAX_OUTSTANDING_PER_SERVER), so 256 is 32 decode ranks' worth waiting at once on it; past
#: it the decodes' own timeouts (transfer_timeout) would fail them anyway, since 4 threads
#: computing checksums of long prompts (about a second each on a host) would not reach them in
#: time.
CHECKSUM_ANSWER_THREADS = 4
MAX_PENDING_CHECKSUM_ANSWERS = 256


def _reason_text(exc: BaseException) -> str:
    return reason_text(str(exc)) or type(exc).__name__


class HandshakeServer(_RouterListener):
    """Answers handshake requests on ``port`` with ``provider(request)``.

    ``provider`` runs on the thread that reads the server (the process's listener hub, shared
    with its other listeners: keep it quick) and returns the :class:`HandshakeResponse` to send
    (its nonce is filled in here). If it raises a :class:`MoriioError` -- say, KV caches not
    registered yet -- the requester gets a :class:`HandshakeRejected` with the message; any
    other exception is logged and rejected as an internal error. Requests that fail
    authentication or the schema get no answer (the requester times out); with a secret, so
    do requests sent more than a minute from this side's clock or whose nonce was answered
    before (a captured request replayed). When ``learn_peers`` is true, the source IP of each
    answered request is added to the allowlist, so this side may later notify that peer.

    ``checksums`` (set where transfers are verified or reads confirmed) answers
    :class:`ChecksumRequest` s the same way, but on a pool of :data:`CHECKSUM_ANSWER_THREADS`
    daemon threads (:class:`~moriio_native.pools.DaemonPool`) whose replies the reading thread
    sends (an answer may read the transfer's blocks: seconds for a long prompt on a host;
    handshakes and other checks go on meanwhile). ``at_once``, when given, is asked first on the
    reading thread and must not wait: its answer, or None to leave the request to the pool (a
    hold check of a transfer known here is a lookup, and the hop to the pool would cost it about
    half again). ``when_ready``, when given, is told of each request left to the pool and calls
    back when it is worth answering (a prefill's: once the transfer's send task came, or the
    wait for it is over), without a thread waiting; ``at_once`` is then asked again on the
    reading thread before the pool is. Past :data:`MAX_PENDING_CHECKSUM_ANSWERS`
    waiting or being answered at once, one is rejected at once ("busy"). Without ``checksums``
    they are rejected ("neither verifies nor confirms"), and requests larger than a handshake
    request are dropped.
    """

    _name = "handshake server"
    _extra_stats = ("answered", "rejected")
    # Replies queued for one requester that does not read them: a requester has at most
    # MAX_OUTSTANDING_PER_SERVER requests outstanding, so more are a peer that stops reading;
    # past the mark the ROUTER drops them (never blocks) instead of holding up to 1000 replies
    # of engine metadata each.
    _sndhwm = 2 * MAX_OUTSTANDING_PER_SERVER

    def __init__(
        self,
        port: int,
        provider: MetadataProvider,
        security: ControlSecurity,
        *,
        bind_host: str = "*",
        learn_peers: bool = True,
        context: zmq.Context | None = None,
        checksums: ChecksumProvider | None = None,
        at_once: ChecksumAtOnce | None = None,
        when_ready: ChecksumReadiness | None = None,
        own_thread: bool = False,
    ) -> None:
        """Binds ``bind_host:port`` (``port=0``: any free port) and has it read by the
        process's listener thread, or by a thread of its own with ``checksums`` or
        ``own_thread`` (as a server of another process would be: for tests and benchmarks that
        stand in for other processes). Raises TransportError when the port cannot be bound."""
        self._provider = provider
        self._checksums = checksums
        self._at_once = at_once
        self._when_ready = when_ready
        # Checksum answers, computed on the pool and sent by the reading thread (the socket's
        # one user), and how many wait for their transfer, for the pool, or are being answered.
        self._answering = (
            None
            if checksums is None
            else DaemonPool(
                CHECKSUM_ANSWER_THREADS,
                "moriio-native-checksum-answer",
                start_now=True,
                exit_wait_s=COMPUTING_EXIT_WAIT_S,
            )
        )
        self._replies: deque[list[bytes]] = deque()
        # Requests ``when_ready`` let go, for the reading thread to ask ``at_once`` again.
        self._answerable: deque[tuple[bytes, ChecksumRequest, _Sender]] = deque()
        self._pending_answers = 0
        self._security = security
        self._learn_peers = learn_peers
        self._fresh_requests = FreshStamps("handshake or checksum request")
        # Whoever reaches the port may send requests that are refused (another protocol
        # version, an engine the provider refuses) in a loop: one line each would flood the log.
        self._rejections = RateLimitedWarnings(logger, "handshake server: rejected requests")
        super().__init__(
            port,
            bind_host=bind_host,
            max_message_bytes=(
                MAX_HANDSHAKE_REQUEST_BYTES if checksums is None else MAX_CHECKSUM_REQUEST_BYTES
            ),
            context=context,
            # ``at_once`` takes its owner's lock (the core's), which its other threads may
            # hold for a while: on a thread of its own, no other listener waits behind it.
            own_thread=own_thread or checksums is not None,
        )

    def _answer(
        self,
        request: ChecksumRequest,
        peer: _Sender,
        provider: ChecksumAtOnce | None,
    ) -> ChecksumResponse | HandshakeRejected | None:
        """``provider``'s answer to ``request`` (None when it leaves it to the pool), a
        refusal when it raises or when nothing answers checksums here."""
        if provider is None:
            asked = "a hold check" if request.hold_only else "checksums"
            return HandshakeRejected(
                f"{asked} of transfer {request.transfer_id} asked, but this instance neither "
                "verifies transfers nor confirms reads (verify and confirm_reads are off here)",
                request.nonce,
            )
        try:
            answer = provider(request)
            return None if answer is None else answer.replace(nonce=request.nonce)
        except MoriioError as exc:
            self._rejections.warn("checksum request from %s rejected: %s", peer, exc)
            return HandshakeRejected(_reason_text(exc), request.nonce)
        except Exception:
            logger.exception("checksum provider failed for %s", peer)
            return HandshakeRejected("internal error on the serving side", request.nonce)

    def _sealed_reply(
        self, identity: bytes, answer: ChecksumResponse | HandshakeRejected
    ) -> list[bytes]:
        """The frames that send ``answer`` to ``identity``, counted (before it is sent, so a
        requester that got the reply also sees it in stats())."""
        self._count("answered" if isinstance(answer, ChecksumResponse) else "rejected")
        return [identity, b"", *self._security.auth.seal(encode(answer))]

    def _answer_later(
        self, sock: zmq.Socket, identity: bytes, request: ChecksumRequest, peer: _Sender
    ) -> None:
        """Answer ``request`` at once when that needs no wait (``at_once``; a refusal when
        nothing answers checksums here), else have the pool answer it once ``when_ready``
        says (the reading thread sends the reply), or refuse it when that cannot be."""
        if self._answering is None:
            answer = self._answer(request, peer, None)  # "neither verifies nor confirms"
        elif self._at_once is not None:
            answer = self._answer(request, peer, self._at_once)
        else:
            answer = None
        if answer is None:
            answer = self._defer(identity, request, peer)
            if answer is None:
                return
        sock.send_multipart(self._sealed_reply(identity, answer))

    def _defer(
        self, identity: bytes, request: ChecksumRequest, peer: _Sender
    ) -> HandshakeRejected | None:
        """Hand ``request`` to ``when_ready`` (or straight to the pool); None when done, else
        the refusal to send: too many wait already, or ``when_ready`` failed."""
        if not self._take_pending_slot():
            asked = "hold check" if request.hold_only else "checksums"
            self._rejections.warn("checksum request from %s rejected: busy", peer)
            return HandshakeRejected(
                f"{asked} of transfer {request.transfer_id} not answered: this instance is "
                f"busy ({MAX_PENDING_CHECKSUM_ANSWERS} checksum requests wait here already)",
                request.nonce,
            )
        if self._when_ready is None:
            self._to_pool(identity, request, peer)
            return None
        try:
            self._when_ready(
                request, functools.partial(self._ready_to_answer, identity, request, peer)
            )
        except Exception:  # it raised before taking go (it must not block nor fail after)
            logger.exception("checksum request from %s: when_ready failed", peer)
            self._free_pending_slot()
            return HandshakeRejected("internal error on the serving side", request.nonce)
        return None

    def _take_pending_slot(self) -> bool:
        """Count one more request waiting or being answered; False when the bound is reached."""
        with self._state_lock:
            if self._pending_answers >= MAX_PENDING_CHECKSUM_ANSWERS:
                return False
            self._pending_answers += 1
            return True

    def _free_pending_slot(self) -> None:
        with self._state_lock:
            self._pending_answers -= 1

    def _ready_to_answer(self, identity: bytes, request: ChecksumRequest, peer: _Sender) -> None:
        """``request`` is worth answering now (``when_ready``'s go). With ``at_once`` the
        reading thread asks it again first (a hold check of a transfer known by now is a
        lookup: no hop to the pool, and no queue behind checksums being computed), else the
        pool answers. Never blocks: ``when_ready`` may call it under its owner's lock."""
        if self._at_once is None:
            self._to_pool(identity, request, peer)
            return
        self._answerable.append((identity, request, peer))
        self._hub.wake()

    def _to_pool(self, identity: bytes, request: ChecksumRequest, peer: _Sender) -> None:
        """Queue ``request``'s answer on the pool (never blocks: ``when_ready`` may call it
        under its owner's lock). A closed server's pool takes none: its requester times out."""
        assert self._answering is not None
        try:
            self._answering.submit(self._answer_on_pool, identity, request, peer)
        except RuntimeError:  # shut down: the server is closing
            self._free_pending_slot()

    def _answer_on_pool(self, identity: bytes, request: ChecksumRequest, peer: _Sender) -> None:
        """Answer ``request`` and queue the reply for the reading thread (woken for it)."""
        try:
            answer = self._answer(request, peer, self._checksums)
            if answer is None:  # a provider typed to return its answer
                answer = HandshakeRejected("internal error on the serving side", request.nonce)
            self._replies.append(self._sealed_reply(identity, answer))
        except Exception:  # its requester times out; nobody reads the pool's futures
            logger.exception("checksum answer for %s failed", peer)
        finally:
            self._free_pending_slot()
        self._hub.wake()

    def _send_replies(self) -> None:
        while self._answerable:
            identity, request, peer = self._answerable.popleft()
            answer = self._answer(request, peer, self._at_once)
            if answer is None:
                self._to_pool(identity, request, peer)
            else:
                self._free_pending_slot()
                self._send_reply(self._sealed_reply(identity, answer))
        while self._replies:
            self._send_reply(self._replies.popleft())

    def _send_reply(self, frames: list[bytes]) -> None:
        try:
            # A ROUTER drops what it cannot route (a requester gone): never blocks.
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("%s on port %d: reply not sent: %s", self._name, self._port, exc)

    def close(self, timeout: float = 5.0) -> None:
        """As :meth:`_RouterListener.close`; checksum answers not started are dropped (their
        requesters time out), one being computed ends on its own and is not sent."""
        super().close(timeout)
        if self._answering is not None and self._pid == os.getpid():
            self._answering.shutdown()

    def _fresh(self, request: HandshakeRequest | ChecksumRequest, peer: _Sender) -> bool:
        """Whether a signed request is fresh: sent within the window of this side's clock, its
        nonce not seen before (else dropped as an authentication failure). A captured request
        replayed must get no signed metadata or checksums, cost no read of the blocks, and
        teach the allowlist nothing. Without a secret nothing is authenticated, so nothing is
        checked."""
        if not self._security.auth.enabled:
            return True
        try:
            self._fresh_requests.accept(request.sent_ms, request.nonce)
        except AuthenticationError as exc:
            self._drop("dropped_auth", peer, str(exc))
            return False
        return True

    def _handle(self, sock: zmq.Socket, identity: bytes, body: list[bytes], peer: _Sender) -> None:
        # Only a checksum request may be larger than a handshake request.
        small = sum(len(frame) for frame in body[:1]) <= MAX_HANDSHAKE_REQUEST_BYTES
        accept: tuple[type[HandshakeRequest | ChecksumRequest], ...] = (
            (HandshakeRequest, ChecksumRequest) if small else (ChecksumRequest,)
        )
        try:
            request = self._open(body, peer, accept, self._max_message_bytes)
        except ProtocolVersionError as exc:
            self._rejections.warn("handshake from %s rejected: %s", peer, exc)
            self._count("rejected")
            rejected = HandshakeRejected(str(exc), exc.nonce)
            sock.send_multipart([identity, b"", *self._security.auth.seal(encode(rejected))])
            return
        if request is None or not self._fresh(request, peer):
            return
        if isinstance(request, ChecksumRequest):
            self._answer_later(sock, identity, request, peer)
            return
        reply: HandshakeResponse | HandshakeRejected
        try:
            response = self._provider(request)
            if not isinstance(response, HandshakeResponse):
                raise TypeError(f"provider returned {type(response).__name__}")
            reply = response.replace(nonce=request.nonce, answered_ms=now_ms())
        except MoriioError as exc:
            self._rejections.warn("handshake from %s rejected: %s", peer, exc)
            reply = HandshakeRejected(_reason_text(exc), request.nonce)
        except Exception:
            logger.exception("handshake provider failed for %s", peer)
            reply = HandshakeRejected("internal error on the serving side", request.nonce)
        if isinstance(reply, HandshakeResponse) and self._learn_peers:
            ip = peer.ip
            if ip:
                self._security.allowlist.learn(ip)
        # Counted before replying, so a requester that got the reply also sees it in stats().
        self._count("answered" if isinstance(reply, HandshakeResponse) else "rejected")
        sock.send_multipart([identity, b"", *self._security.auth.seal(encode(reply))])
        logger.debug(
            "handshake %s for %s (%s)",
            "answered" if isinstance(reply, HandshakeResponse) else "rejected",
            request.requester_engine_id,
            peer,
        )


_HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
SECRET_MISMATCH = (
    "one side has an auth_secret and the other none (ZMQ's handshake found different security "
    "mechanisms)"
)
HANDSHAKE_CLOSED = (
    "the peer closed the connection during ZMQ's handshake (it has another auth_secret, "
    "accepts only its allowed_peers, or the handshake took longer than its "
    "listener_handshake_timeout, 2 s unless set: an overloaded host or a slow link)"
)
HANDSHAKE_PROTOCOL_ERROR = (
    "ZMQ's handshake failed with a protocol error (the peer is not a ZMQ socket of this "
    "kind, or its security settings differ); ZMQ does not retry such a connection"
)
#: A watch's events that also tell when an established connection ended (PolledRequests).
_CONNECTION_EVENTS = (
    _HANDSHAKE_FAILED_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
)


class _HandshakeWatch:
    """The ZMQ handshake failures of one dialing socket (a monitor of those events only), read
    by the thread that uses the socket. A secret on one side only, or two secrets, fail every
    connection inside ZMQ, where neither side's listener sees a message: this names it on the
    dialing side. The events are few (one per reconnection, at most ten a second), and each
    owner reads them as it waits, so the monitor's queue never fills (a full one would stall
    ZMQ's I/O thread). A protocol failure (different security mechanisms among them) ends the
    socket's connection for good: ZMQ does not reconnect after one (``ended``), so its owner
    must dial again on a new socket."""

    def __init__(self, sock: zmq.Socket, events: int = _HANDSHAKE_FAILED_EVENTS) -> None:
        """Watch ``sock`` (before its connect) for ``events`` (handshake failures)."""
        self._sock = sock
        address = f"inproc://moriio-native.handshake-watch.{next(_MONITOR_IDS)}"
        self.monitor = sock.get_monitor_socket(events, address)
        self.failures = 0
        self.mismatch = False  # a failure that can only be a secret on one side
        self.ended = False  # a protocol failure: ZMQ will not reconnect this socket
        self.reason = ""
        # Watched with _CONNECTION_EVENTS: connections that ended after their handshake
        # succeeded (whatever was sent on one and not answered is lost with it).
        self.dropped = 0
        self._established = False

    def read(self) -> bool:
        """Take what the monitor reported (never blocks); whether there was a failure."""
        failed = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._established = True
                continue
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.dropped += self._established
                self._established = False
                continue
            failed = True
            self.failures += 1
            self.ended = self.ended or event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            if (
                event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                and event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
            ):
                self.mismatch = True
                self.reason = SECRET_MISMATCH
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and not self.mismatch:
                self.reason = HANDSHAKE_PROTOCOL_ERROR
            elif not self.mismatch:
                self.reason = HANDSHAKE_CLOSED
        return failed

    def close(self) -> None:
        """Stop watching and close the monitor, also when the socket's context was terminated
        (disable_monitor then fails): an open monitor would keep the context's term() waiting
        for ever."""
        try:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
        finally:
            self.monitor.close(linger=0)


@dataclass(frozen=True, slots=True)
class _Dialed:
    """A notify sender's socket to one peer and the watch of its handshakes."""

    sock: zmq.Socket
    watch: _HandshakeWatch

    def close(self, linger_ms: int) -> None:
        try:
            self.watch.close()
        finally:
            self.sock.close(linger=linger_ms)


def _dial(
    context: zmq.Context,
    endpoint: str,
    auth: MessageAuth,
    options: dict[int, int],
    events: int = _HANDSHAKE_FAILED_EVENTS,
) -> _Dialed:
    """A DEALER with ``options`` (ZMQ option -> value), secured with ``auth``'s secret (CURVE,
    when it has one), its handshake failures among ``events`` watched, connected to
    ``endpoint``; nothing left open when that fails."""
    sock = context.socket(zmq.DEALER)
    watch = None
    try:
        for option, value in options.items():
            sock.setsockopt(option, value)
        auth.secure_dialer(sock)
        watch = _HandshakeWatch(sock, events)
        sock.connect(endpoint)
    except BaseException:
        if watch is not None:
            watch.close()
        sock.close(linger=0)
        raise
    return _Dialed(sock, watch)


def _check_seconds(value: float, what: str) -> float:
    seconds = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond any float
            seconds = math.inf
    if not 0 < seconds < math.inf:  # NaN fails this too
        raise InvalidArgumentError(f"{what} must be a positive number of seconds, got {value!r}")
    return seconds


def fetch_metadata(
    host: str,
    port: int,
    *,
    timeout: float,
    security: ControlSecurity,
    requester_engine_id: str,
    context: zmq.Context | None = None,
    max_response_bytes: int = MAX_HANDSHAKE_RESPONSE_BYTES,
    verify: bool = False,
    confirm_reads: bool = False,
) -> HandshakeResponse:
    """Ask the handshake server at ``host:port`` for its metadata (``verify``: whether this
    side checks transfers end to end, the server refuses a mismatch; ``confirm_reads``: whether
    this side confirms its READs with hold checks, refused by a server that answers none).

    Checks the allowlist first (PeerNotAllowedError, no socket created). Then one request,
    waiting at most ``timeout`` seconds: TransferTimeoutError when no reply came (dead port,
    unreachable host), TransportError for a malformed reply, AuthenticationError for a reply
    with a bad tag or one not answering our nonce, FailedPreconditionError when the peer
    rejected the request (its reason included), IncompatiblePeerError for another protocol
    version. Blocks the calling thread; thread-safe (uses its own socket).
    """
    request = HandshakeRequest(requester_engine_id, verify=verify, confirm_reads=confirm_reads)
    reply = _ask(
        host,
        port,
        request,
        (HandshakeResponse, HandshakeRejected),
        what="handshake with",
        timeout=timeout,
        security=security,
        context=context,
        max_response_bytes=max_response_bytes,
    )
    assert isinstance(reply, HandshakeResponse)
    return reply


def ask_checksums(
    requests: PolledRequests,
    host: str,
    port: int,
    request: ChecksumRequest,
    *,
    timeout: float,
    done: Callable[[ChecksumResponse | MoriioError], None],
) -> None:
    """Ask the handshake server at ``host:port`` (a prefill rank) for the checksums ``request``
    names, waited for by ``requests``' thread: ``done`` gets the answer, or within ``timeout``
    seconds the error (as :func:`fetch_metadata`'s: FailedPreconditionError with the peer's
    reason when it rejects, e.g. it does not verify; TransportError when the answer is for
    another transfer). Raises at once, calling nothing, as :meth:`PolledRequests.ask` does."""

    def answered(outcome: _Reply | MoriioError) -> None:
        if not isinstance(outcome, MoriioError):
            try:
                outcome = _checksums_answer(outcome, request, host, port)
            except TransportError as exc:
                outcome = exc
        done(outcome)

    requests.ask(
        host,
        port,
        request,
        (ChecksumResponse, HandshakeRejected),
        what=_checksums_what(request),
        timeout=timeout,
        done=answered,
    )


def _checksums_what(request: ChecksumRequest) -> str:
    return f"checksums of transfer {request.transfer_id} from"


def _checksums_answer(
    reply: _Reply, request: ChecksumRequest, host: str, port: int
) -> ChecksumResponse:
    """``reply`` to ``request``: a ChecksumResponse for its transfer, else TransportError."""
    assert isinstance(reply, ChecksumResponse)
    if reply.transfer_id != request.transfer_id:
        raise TransportError(
            f"checksums from {host}:{port}: the answer is for transfer {reply.transfer_id}, we "
            f"asked for {request.transfer_id}"
        )
    return reply


_Request = HandshakeRequest | ChecksumRequest
_Reply = HandshakeResponse | ChecksumResponse | HandshakeRejected


def _ask(
    host: str,
    port: int,
    request: _Request,
    accept: tuple[type[_Reply], ...],
    *,
    what: str,
    timeout: float,
    security: ControlSecurity,
    context: zmq.Context | None,
    max_response_bytes: int,
) -> _Reply:
    """One request on the handshake channel, on a connection of its own, and its reply (never
    a rejection: that raises)."""
    host, port, timeout, target = _ask_target(host, port, timeout, security, what)
    dialed = _dial_asker(context, host, port, security, max_response_bytes, f"{what} {target}")
    try:
        return _exchange(
            dialed.sock,
            dialed.watch,
            request,
            accept,
            f"{what} {target}",
            timeout,
            security,
            max_response_bytes,
        )
    finally:
        dialed.close(0)


def _ask_target(
    host: str, port: int, timeout: float, security: ControlSecurity, what: str
) -> tuple[str, int, float, str]:
    """A request's checked ``(host, port, timeout, "host:port")``: the port and timeout
    valid, the host allowlisted (PeerNotAllowedError before any socket exists)."""
    port = validate_port(port, what="handshake port")
    timeout = _check_seconds(timeout, "timeout")
    target = f"{host}:{port}"
    return security.allowlist.require(host, purpose=f"{what} {target}"), port, timeout, target


def _dial_asker(
    context: zmq.Context | None,
    host: str,
    port: int,
    security: ControlSecurity,
    max_response_bytes: int,
    what: str,
    events: int = _HANDSHAKE_FAILED_EVENTS,
) -> _Dialed:
    """A DEALER to the handshake server at ``host:port`` (allowlisted already), its ``events``
    watched."""
    ctx = context if context is not None else zmq.Context.instance()
    options = {zmq.LINGER: 0, zmq.IPV6: 1, zmq.MAXMSGSIZE: 2 * max_response_bytes + 4096}
    try:
        return _dial(ctx, zmq_endpoint(host, port), security.auth, options, events)
    except zmq.ZMQError as exc:
        raise TransportError(f"{what}: cannot connect: {exc}") from exc


def _exchange(
    sock: zmq.Socket,
    watch: _HandshakeWatch,
    request: _Request,
    accept: tuple[type[_Reply], ...],
    what: str,
    timeout: float,
    security: ControlSecurity,
    max_response_bytes: int,
) -> _Reply:
    """Send ``request`` on ``sock`` (a new connection) and wait for its reply, naming
    ``watch``'s handshake failures."""
    _send_request(sock, request, what, security)
    deadline = time.monotonic() + timeout
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(watch.monitor, zmq.POLLIN)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _no_reply(what, timeout, watch)
        ready = dict(poller.poll(max(1, int(min(remaining, _POLL_MS / 1000) * 1000))))
        if watch.monitor in ready and watch.read() and watch.mismatch:
            raise AuthenticationError(f"{what}: {watch.reason}")
        if sock not in ready:
            continue
        reply = _open_reply(sock.recv_multipart(), accept, what, security, max_response_bytes)
        if reply.nonce != request.nonce:
            raise AuthenticationError(f"{what}: reply does not answer our request (nonce mismatch)")
        return _unless_rejected(reply, what)


def _send_request(
    sock: zmq.Socket, request: _Request, what: str, security: ControlSecurity
) -> None:
    """``request``, sealed, onto ``sock`` without waiting (TransportError when ZMQ refuses)."""
    try:
        sock.send_multipart(security.auth.seal(encode(request)), flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        raise TransportError(f"{what}: cannot send: {exc}") from exc


# How long a send ZMQ refused waits for its connection's handshake failure to be reported: ZMQ's
# I/O thread reports it before it drops the connection the send then finds gone.
_HANDSHAKE_REPORT_MS = 50


def _named_by_handshake(exc: MoriioError, watch: _HandshakeWatch, what: str) -> MoriioError:
    """A send ZMQ refused (no connection left: its handshake failed), named by that failure
    when the connection's monitor reports one; else ``exc`` as it is."""
    watch.monitor.poll(_HANDSHAKE_REPORT_MS)
    watch.read()
    if not watch.reason:
        return exc
    if watch.mismatch:
        return AuthenticationError(f"{what}: {watch.reason}")
    return TransportError(f"{what}: {watch.reason}")


def _no_reply(what: str, timeout: float, watch: _HandshakeWatch) -> TransferTimeoutError:
    """The error of a request not answered within ``timeout``, with what ``watch`` saw."""
    failed = (
        f"; ZMQ's handshake failed {watch.failures} times: {watch.reason}" if watch.failures else ""
    )
    return TransferTimeoutError(
        f"{what}: no reply within {timeout:.3g}s "
        "(is the peer running, the port right, and auth_secret the same on both "
        f"sides?){failed}"
    )


def _open_reply(
    frames: list[bytes],
    accept: tuple[type[_Reply], ...],
    what: str,
    security: ControlSecurity,
    max_response_bytes: int,
) -> _Reply:
    """The reply in a DEALER's ``frames``, authenticated and decoded (its nonce unchecked)."""
    if len(frames) < 2 or frames[0] != b"":
        raise TransportError(f"{what}: reply is not [b'', payload]")
    payload = security.auth.open(frames[1:])
    try:
        return decode(payload, accept, max_bytes=max_response_bytes)
    except ProtocolVersionError as exc:
        raise IncompatiblePeerError(f"{what}: {exc}") from exc
    except InvalidMessageError as exc:
        raise TransportError(f"{what}: bad reply: {exc}") from exc


def _unless_rejected(reply: _Reply, what: str) -> _Reply:
    """``reply``, or FailedPreconditionError with the peer's reason when it is a rejection."""
    if isinstance(reply, HandshakeRejected):
        raise FailedPreconditionError(f"{what} rejected by the peer: {reply.reason}")
    return reply


#: The longest :class:`PolledRequests`' thread waits in one poll (it then looks again).
_POLLED_WAIT_CAP_MS = 60_000
#: How long :meth:`PolledRequests.close` waits for its thread to end the requests in flight.
_POLLED_CLOSE_WAIT_S = 5.0

#: The replies a :class:`PolledRequests` reads before it knows whose they are.
_REPLY_TYPES = (HandshakeResponse, ChecksumResponse, HandshakeRejected)
#: A :class:`PolledRequests` request's callback: it gets the reply, or why there is none.
RequestDone = Callable[["_Reply | MoriioError"], None]


@dataclass(eq=False, slots=True)
class _Waiting:
    """A request sent (or about to be) and waiting for its reply."""

    host: str
    port: int
    request: _Request
    accept: tuple[type[_Reply], ...]
    what: str  # "<what> host:port", the start of every error it gets
    timeout: float
    deadline: float  # time.monotonic()
    done: RequestDone


@dataclass(eq=False, slots=True)
class _Connection:
    """A connection to one server, its requests outstanding by nonce. A retired one takes no
    new requests (one of its requests went unanswered, or ZMQ gave it up): it closes once the
    others have ended."""

    key: tuple[str, int]
    sock: zmq.Socket
    # Read on every turn it reports, for the connection's life: a server replaced by one with
    # another secret (or none) is named at once, not after a request's whole wait.
    watch: _HandshakeWatch
    waiting: dict[bytes, _Waiting]
    retired: bool = False
    idle_since: float | None = None  # time.monotonic() since when nothing is outstanding


_Finished = list[tuple[_Waiting, "_Reply | MoriioError"]]


def _not_sent(waiting: _Waiting, outstanding: int) -> TransferTimeoutError:
    """The error of a request whose deadline came before its turn to be sent."""
    return TransferTimeoutError(
        f"{waiting.what}: no reply within {waiting.timeout:.3g}s: not sent, {outstanding} "
        "earlier requests to it still unanswered (is the peer running?)"
    )


class PolledRequests:
    """Requests to handshake servers (a decode's hold checks) that one thread, named ``name``,
    waits for, however many are asked: each goes on the one connection kept to its server (up
    to ``max_outstanding`` side by side on it, each reply matched to its request by nonce; the
    others wait for their turn, oldest first), and its ``done`` callback gets the reply, or the
    error, by its deadline (counted from the ask, turn included). A server that never answers
    therefore holds up no other server's requests, and keeps no thread.

    A secret on one side only (ZMQ's handshake fails for that reason) fails the requests on
    the connection at once and closes it. A request unanswered by its deadline fails with
    TransferTimeoutError and retires its connection: the next request to that server dials a
    new one (a connection that no longer works shows only so), and the retired one closes once
    its other requests have ended. A reply that cannot be read (not authenticated, malformed,
    another protocol version with no nonce to tell whose) fails every request outstanding on
    its connection, which closes. A connection with nothing outstanding is kept ``idle_s``
    seconds for the next request (at most ``max_idle`` kept, the least recently used closed
    first).

    Callbacks run on the thread, one at a time, after its state is updated: they must not
    block (they may call :meth:`ask`). :meth:`close` ends every request still waiting with an
    error. Thread-safe."""

    def __init__(
        self,
        security: ControlSecurity,
        name: str,
        *,
        idle_s: float = 30.0,
        max_idle: int = 16,
        max_outstanding: int = MAX_OUTSTANDING_PER_SERVER,
        max_response_bytes: int = MAX_HANDSHAKE_RESPONSE_BYTES,
        context: zmq.Context | None = None,
    ) -> None:
        """Starts the thread (RuntimeError when it cannot start)."""
        if max_idle < 1 or max_outstanding < 1:
            raise InvalidArgumentError(
                f"max_idle and max_outstanding must be >= 1, got {max_idle}, {max_outstanding}"
            )
        self._security = security
        self._idle_s = _check_seconds(idle_s, "idle_s")
        self._max_idle = max_idle
        self._max_outstanding = max_outstanding
        self._max_response_bytes = max_response_bytes
        self._context = context
        self._lock = threading.Lock()
        self._incoming: deque[_Waiting] = deque()  # asked, not yet taken by the thread
        self._closed = False
        self._idle_now = 0
        self._pid = os.getpid()  # a forked child has the object but not the thread
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        # The thread's own: the requests waiting for their turn to be sent, per server; the
        # connection new requests to a server go on; the retired ones.
        self._queued: dict[tuple[str, int], deque[_Waiting]] = {}
        self._current: dict[tuple[str, int], _Connection] = {}
        self._retired: list[_Connection] = []
        # Outcomes of this turn, called at its end (or by _stop_all if the turn fails).
        self._finished: _Finished = []
        self._poller = zmq.Poller()
        self._poller.register(self._wake_read, zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._close_wake_pipe()
            raise

    @property
    def idle(self) -> int:
        """Connections kept with nothing outstanding on them (as of the thread's last turn)."""
        return self._idle_now

    def ask(
        self,
        host: str,
        port: int,
        request: _Request,
        accept: tuple[type[_Reply], ...],
        *,
        what: str,
        timeout: float,
        done: RequestDone,
    ) -> None:
        """Send ``request`` to the handshake server at ``host:port``; ``done`` gets its reply
        (one of ``accept``) or, ``timeout`` seconds from now at the latest, the error (as
        :func:`fetch_metadata`'s: FailedPreconditionError with the server's reason when it
        rejects). Raises at once, calling nothing, when the host is not allowlisted, the port
        or timeout is invalid, or this is closed (or was made by the process this one forked
        from: its thread is not here)."""
        host, port, timeout, target = _ask_target(host, port, timeout, self._security, what)
        waiting = _Waiting(
            host,
            port,
            request,
            accept,
            f"{what} {target}",
            timeout,
            time.monotonic() + timeout,
            done,
        )
        if os.getpid() != self._pid:
            raise FailedPreconditionError(f"{waiting.what}: a requester of the parent process")
        with self._lock:
            if self._closed:
                raise FailedPreconditionError(f"{waiting.what}: the requester is closed")
            self._incoming.append(waiting)
            self._wake()

    def close(self) -> None:
        """End every request still waiting (its ``done`` gets FailedPreconditionError), close
        the connections and stop the thread, waiting for that up to a few seconds unless
        called from a callback. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(_POLLED_CLOSE_WAIT_S)

    def _wake(self) -> None:
        """Wake the thread (lock held: the thread closes the pipe under it, once closed, so
        this never writes to a descriptor number reused meanwhile)."""
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            os.write(self._wake_write, b"w")

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except zmq.ContextTerminated:  # the process ending its ZMQ context: nothing is wrong
            logger.info("%s stopped: its ZMQ context was terminated", self._thread.name)
        except Exception:
            logger.exception("%s stopped on an internal error", self._thread.name)
        finally:
            self._stop_all()

    def _turn(self) -> bool:
        """One wait and what it brought; False once closed."""
        ready = dict(self._poller.poll(self._wait_ms(time.monotonic())))
        with self._lock:
            if self._closed:
                return False
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_read, 4096):
                    pass
            incoming = list(self._incoming)
            self._incoming.clear()
        for waiting in incoming:
            self._queued.setdefault((waiting.host, waiting.port), deque()).append(waiting)
        finished = self._finished
        for conn in self._connections():  # replies first: one that came is never lost
            if conn.sock in ready:
                self._read_replies(conn, finished)
            if conn.watch.monitor in ready and not conn.sock.closed:
                self._read_watch(conn, finished)
        now = time.monotonic()
        self._end_late(now, finished)
        self._send_queued(finished)
        self._settle(now)
        self._finished = []
        for waiting, outcome in finished:
            self._call(waiting, outcome)
        return True

    def _wait_ms(self, now: float) -> int:
        """Until the next deadline or idle expiry (-1: none, wait for a wake-up)."""
        times = [w.deadline for conn in self._connections() for w in conn.waiting.values()]
        times += [w.deadline for queue in self._queued.values() for w in queue]
        times += [c.idle_since + self._idle_s for c in self._current.values() if c.idle_since]
        if not times:
            return -1
        # Capped: a deadline weeks away (transfer_timeout may be up to a year) is beyond the
        # int zmq's poll takes (OverflowError past 2**31 ms would end the thread).
        return max(1, min(_POLLED_WAIT_CAP_MS, math.ceil((min(times) - now) * 1000)))

    def _connections(self) -> list[_Connection]:
        return [*self._current.values(), *self._retired]

    def _send_queued(self, finished: _Finished) -> None:
        """Send each server's queued requests, oldest first, while fewer than
        ``max_outstanding`` of its requests are outstanding."""
        for key, queue in list(self._queued.items()):
            room = self._max_outstanding - self._outstanding(key)
            while queue and room > 0:
                self._send(key, queue.popleft(), finished)
                room -= 1
            if not queue:
                del self._queued[key]

    def _outstanding(self, key: tuple[str, int]) -> int:
        """Requests sent to ``key``'s server and not ended, on any of its connections."""
        return sum(len(c.waiting) for c in self._connections() if c.key == key)

    def _send(self, key: tuple[str, int], waiting: _Waiting, finished: _Finished) -> None:
        """``waiting``'s request onto its server's connection (dialled when there is none); a
        request it cannot send ends at once, and so does one whose nonce another request to
        that server still waits on (its reply could not be told from the other's)."""
        nonce = waiting.request.nonce
        if any(nonce in c.waiting for c in self._connections() if c.key == key):
            finished.append(
                (waiting, InvalidArgumentError(f"{waiting.what}: its nonce is outstanding already"))
            )
            return
        conn = self._current.get(key)
        try:
            if conn is None:
                conn = self._dial(key, waiting.what)
            try:
                _send_request(conn.sock, waiting.request, waiting.what, self._security)
            except MoriioError as exc:
                self._retire(conn)  # ZMQ gave it up, or it is full: the next one dials anew
                raise _named_by_handshake(exc, conn.watch, waiting.what) from exc
        except MoriioError as exc:
            finished.append((waiting, exc))
            return
        except Exception as exc:  # a defect: this request fails, the others go on
            logger.exception("%s: could not be sent", waiting.what)
            finished.append((waiting, TransportError(f"{waiting.what}: cannot send: {exc}")))
            return
        conn.waiting[nonce] = waiting

    def _dial(self, key: tuple[str, int], what: str) -> _Connection:
        dialed = _dial_asker(
            self._context,
            key[0],
            key[1],
            self._security,
            self._max_response_bytes,
            what,
            _CONNECTION_EVENTS,
        )
        conn = _Connection(key, dialed.sock, dialed.watch, {})
        self._poller.register(conn.sock, zmq.POLLIN)
        self._poller.register(dialed.watch.monitor, zmq.POLLIN)
        self._current[key] = conn
        return conn

    def _read_watch(self, conn: _Connection, finished: _Finished) -> None:
        """What ZMQ reported of ``conn`` (after its replies were read): a secret on one side
        only, or a protocol failure (ZMQ will not reconnect), ends its requests at once and
        closes it; an established connection that dropped (the server restarted, the link
        went) loses the requests sent on it, which end at once too, while ZMQ dials again for
        the next ones."""
        watch = conn.watch
        dropped = watch.dropped
        watch.read()
        if watch.mismatch:
            self._drop(conn, AuthenticationError, watch.reason, finished)
        elif watch.ended:
            self._drop(conn, TransportError, watch.reason, finished)
        elif watch.dropped > dropped:
            self._read_replies(conn, finished)  # a reply that came before the drop counts
            for waiting in conn.waiting.values():  # its reply would go to the old connection
                finished.append(
                    (
                        waiting,
                        TransportError(
                            f"{waiting.what}: the connection dropped before the reply came"
                        ),
                    )
                )
            conn.waiting.clear()

    def _read_replies(self, conn: _Connection, finished: _Finished) -> None:
        while not conn.sock.closed:
            try:
                frames = conn.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._take_reply(conn, frames, finished)

    def _take_reply(self, conn: _Connection, frames: list[bytes], finished: _Finished) -> None:
        try:
            reply = _open_reply(
                frames,
                _REPLY_TYPES,
                "a reply on its connection",
                self._security,
                self._max_response_bytes,
            )
        except IncompatiblePeerError as exc:
            # Another protocol version: its error names the request's nonce when it could.
            nonce = getattr(exc.__cause__, "nonce", b"")
            waiting = conn.waiting.pop(nonce, None) if nonce else None
            if waiting is None:
                self._drop(conn, IncompatiblePeerError, str(exc), finished)
            else:
                finished.append((waiting, IncompatiblePeerError(f"{waiting.what}: {exc}")))
            return
        except MoriioError as exc:
            self._drop(conn, type(exc), str(exc), finished)
            return
        waiting = conn.waiting.pop(reply.nonce, None)
        if waiting is None:  # a request that ended already (its deadline passed meanwhile)
            logger.debug("a reply from %s:%d answers no request waiting; dropped", *conn.key)
            return
        finished.append((waiting, self._answer(waiting, reply)))

    @staticmethod
    def _answer(waiting: _Waiting, reply: _Reply) -> _Reply | MoriioError:
        try:
            _unless_rejected(reply, waiting.what)
        except FailedPreconditionError as exc:
            return exc
        if not isinstance(reply, waiting.accept):
            return TransportError(
                f"{waiting.what}: answered with a {type(reply).__name__}, not what was asked"
            )
        return reply

    def _end_late(self, now: float, finished: _Finished) -> None:
        """End the requests past their deadline, retiring the connections they were sent on."""
        for key, queue in self._queued.items():
            late = [w for w in queue if w.deadline <= now]
            for waiting in late:
                queue.remove(waiting)
                finished.append((waiting, _not_sent(waiting, self._outstanding(key))))
        for conn in self._connections():
            late = [nonce for nonce, w in conn.waiting.items() if w.deadline <= now]
            for nonce in late:
                waiting = conn.waiting.pop(nonce)
                finished.append((waiting, _no_reply(waiting.what, waiting.timeout, conn.watch)))
            if late:
                self._retire(conn)

    def _settle(self, now: float) -> None:
        """Close the retired connections with nothing left outstanding, and the kept ones idle
        past ``idle_s`` or beyond ``max_idle``; the others idle from now when their last
        request just ended."""
        for conn in [c for c in self._retired if not c.waiting]:
            self._close(conn)
        for conn in self._current.values():
            if conn.waiting:
                conn.idle_since = None
            elif conn.idle_since is None:
                conn.idle_since = now
        idle = sorted(
            (c for c in self._current.values() if c.idle_since is not None),
            key=lambda c: c.idle_since or 0.0,
        )
        for kept, conn in enumerate(reversed(idle)):
            assert conn.idle_since is not None
            if kept >= self._max_idle or now - conn.idle_since >= self._idle_s:
                self._close(conn)
        self._idle_now = sum(1 for c in self._current.values() if c.idle_since is not None)

    def _retire(self, conn: _Connection) -> None:
        if not conn.retired:
            conn.retired = True
            del self._current[conn.key]
            self._retired.append(conn)

    def _drop(
        self, conn: _Connection, error: type[MoriioError], reason: str, finished: _Finished
    ) -> None:
        """End every request outstanding on ``conn`` with ``error`` and close it."""
        for waiting in conn.waiting.values():
            finished.append((waiting, error(f"{waiting.what}: {reason}")))
        conn.waiting.clear()
        self._close(conn)

    def _close(self, conn: _Connection) -> None:
        if conn.retired:
            self._retired.remove(conn)
        else:
            del self._current[conn.key]
        self._poller.unregister(conn.sock)
        self._poller.unregister(conn.watch.monitor)
        conn.watch.close()
        conn.sock.close(linger=0)

    def _call(self, waiting: _Waiting, outcome: _Reply | MoriioError) -> None:
        try:
            waiting.done(outcome)
        except Exception:
            logger.exception("%s: its callback failed", waiting.what)

    def _stop_all(self) -> None:
        """Closed (or the thread failing): end every request with an error, close all."""
        with self._lock:
            self._closed = True
            unsent = [*self._incoming, *(w for queue in self._queued.values() for w in queue)]
            self._incoming.clear()
            self._queued.clear()
            self._close_wake_pipe()
        finished, self._finished = self._finished, []
        finished += [
            (w, FailedPreconditionError(f"{w.what}: closed before it was sent")) for w in unsent
        ]
        for conn in self._connections():
            self._drop(conn, FailedPreconditionError, "closed before the reply came", finished)
        self._idle_now = 0
        for waiting, outcome in finished:
            self._call(waiting, outcome)

    def _close_wake_pipe(self) -> None:
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)


class NotifySender(_ClosesOnExit):
    """Sends notify messages to peers' notify listeners, fire-and-forget.

    One DEALER socket per ``(host, port)``, kept in an LRU of ``max_peers`` (the oldest is
    closed when full). A socket queues messages while its connection is being (re)made, up
    to ``send_hwm``; beyond that :meth:`send` raises TransportError instead of blocking.
    Closing a socket lets ZMQ try to flush queued messages for ``linger_ms`` in the
    background. Thread-safe: one lock serialises all socket use.
    """

    def __init__(
        self,
        security: ControlSecurity,
        *,
        max_peers: int = 256,
        send_hwm: int = 10000,
        linger_ms: int = 1000,
        context: zmq.Context | None = None,
    ) -> None:
        if max_peers < 1 or send_hwm < 1 or linger_ms < 0:
            raise InvalidArgumentError("max_peers and send_hwm must be >= 1, linger_ms >= 0")
        self._security = security
        self._context = context if context is not None else zmq.Context.instance()
        self._max_peers = max_peers
        self._send_hwm = send_hwm
        self._linger_ms = linger_ms
        self._lock = threading.Lock()
        self._sockets: OrderedDict[tuple[str, int], _Dialed] = OrderedDict()
        self._closed = False
        self._redialled = RateLimitedWarnings(logger, "notify connections dialled again")

    def send(self, host: str, port: int, message: NotifyMessage) -> None:
        """Queue ``message`` for the notify listener at ``host:port``.

        Raises InvalidArgumentError for a bad port or non-notify message, PeerNotAllowedError
        when ``host`` is not allowlisted (logged; no socket created), TransportError when the
        peer's queue is full or ZMQ fails, FailedPreconditionError after :meth:`close`. Never
        blocks on the network.
        """
        port = validate_port(port, what="notify port")
        if not isinstance(message, NOTIFY_TYPES):
            raise InvalidArgumentError(f"{type(message).__name__} is not a notify message")
        target = f"{host}:{port}"
        host = self._security.allowlist.require(
            host, purpose=f"{message.TYPE} of transfer {message.transfer_id} to {target}"
        )
        frames = self._security.auth.seal(encode(message))
        key = (host, port)
        with self._lock:
            if self._closed:
                raise FailedPreconditionError("notify sender is closed")
            dialed = self._sockets.get(key)
            if dialed is not None and dialed.watch.read() and dialed.watch.ended:
                # ZMQ gave this connection up for good (its handshake failed on the protocol):
                # messages would queue on it forever, even once the peer is fixed. Dial again.
                self._redialled.warn(
                    "notify connection to %s: %s; dialling again", target, dialed.watch.reason
                )
                del self._sockets[key]
                dialed.close(0)
                dialed = None
            if dialed is None:
                try:
                    dialed = self._open(host, port)
                except zmq.ZMQError as exc:  # a socket limit, a terminated context
                    raise TransportError(
                        f"{message.TYPE} of transfer {message.transfer_id} to {target}: "
                        f"cannot open a socket: {exc}"
                    ) from exc
                self._sockets[key] = dialed
                while len(self._sockets) > self._max_peers:
                    _, old = self._sockets.popitem(last=False)
                    old.close(self._linger_ms)
            self._sockets.move_to_end(key)
            sock = dialed.sock
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again as exc:
                raise TransportError(
                    f"{message.TYPE} of transfer {message.transfer_id} to {target}: send queue "
                    f"full ({self._send_hwm} messages; is the peer's listener running?)"
                ) from exc
            except zmq.ZMQError as exc:
                self._sockets.pop(key, None)
                dialed.close(0)
                raise TransportError(
                    f"{message.TYPE} of transfer {message.transfer_id} to {target}: {exc}"
                ) from exc

    def _open(self, host: str, port: int) -> _Dialed:
        options = {zmq.LINGER: self._linger_ms, zmq.SNDHWM: self._send_hwm, zmq.IPV6: 1}
        # Protocol failures only: each ends the connection, so a socket reports one at most and
        # its unread monitor cannot fill (a send reads it).
        events = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        endpoint = zmq_endpoint(host, port)
        return _dial(self._context, endpoint, self._security.auth, options, events)

    def close(self) -> None:
        """Close every socket (queued messages get ``linger_ms`` to flush, in the background).
        Idempotent; later :meth:`send` calls raise FailedPreconditionError."""
        with self._lock:
            self._closed = True
            sockets, self._sockets = list(self._sockets.values()), OrderedDict()
        for dialed in sockets:
            dialed.close(self._linger_ms)


class ProxyPinger:
    """Registers this instance with vLLM's MoRIIO proxy/router: sends ``registration`` to
    ``proxy_host:proxy_port`` now and then every ``interval`` seconds until :meth:`stop`.

    Pings are signed when ``auth`` has a secret (a fresh stamp each, see
    :class:`~.security.RegistrationVerifier`), else one untagged frame as vLLM's router expects.
    They never queue up while the proxy is down (``ZMQ_IMMEDIATE``): a missed ping is simply
    skipped. Only one worker per instance (world rank 0) should run one. When an allowlist is
    given, the proxy host must pass it.
    """

    def __init__(
        self,
        proxy_host: str,
        proxy_port: int,
        registration: ProxyRegistration,
        *,
        interval: float = 3.0,
        allowlist: PeerAllowlist | None = None,
        auth: MessageAuth | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        """Validates the arguments (InvalidArgumentError) and, with an allowlist, the proxy
        host (PeerNotAllowedError); does not start the thread. ``auth``: sign the pings with
        its secret (``None`` or no secret: unsigned)."""
        if not isinstance(registration, ProxyRegistration):
            raise InvalidArgumentError("registration must be a ProxyRegistration")
        self._interval = _check_seconds(interval, "interval")
        proxy_port = validate_port(proxy_port, what="proxy_ping_port")
        host = validate_host(proxy_host, what="proxy_ip")
        if allowlist is not None:
            host = allowlist.require(host, purpose=f"proxy registration to {host}:{proxy_port}")
        self._endpoint = zmq_endpoint(host, proxy_port)
        self._payload = encode(registration)
        self._auth = auth if auth is not None else MessageAuth(None)
        self._context = context if context is not None else zmq.Context.instance()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._sent = 0

    @property
    def pings_sent(self) -> int:
        """How many pings were handed to ZMQ so far."""
        with self._lock:
            return self._sent

    def start(self) -> ProxyPinger:
        """Start the thread (once; later calls do nothing). Returns self."""
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="moriio-proxy-pinger", daemon=True
                )
                self._thread.start()
        return self

    def _dial(self) -> _Dialed:
        options = {zmq.LINGER: 0, zmq.IMMEDIATE: 1, zmq.SNDHWM: 1, zmq.IPV6: 1}
        # (Signed pings go to a proxy with the secret: CURVE then, as the instances' sockets.)
        return _dial(self._context, self._endpoint, self._auth, options)

    def _dial_until_stopped(self) -> _Dialed | None:
        """A dialled socket, trying again every ``_PROXY_REDIAL_S`` while ZMQ refuses one (its
        context's socket limit, say: the thread must not end on it); None once stopped."""
        warned = -math.inf
        while not self._stop.is_set():
            try:
                return self._dial()
            except zmq.ZMQError as exc:
                if time.monotonic() - warned >= _PROXY_HANDSHAKE_WARN_EVERY_S:
                    warned = time.monotonic()
                    logger.warning(
                        "proxy registration to %s: cannot open a socket (%s); trying again",
                        self._endpoint,
                        exc,
                    )
                self._stop.wait(_PROXY_REDIAL_S)
        return None

    def _run(self) -> None:
        dialed = self._dial_until_stopped()
        if dialed is None:
            return
        try:
            next_ping = time.monotonic()
            warned = -math.inf
            while not self._stop.is_set():
                if time.monotonic() >= next_ping:
                    self._ping(dialed.sock)
                    next_ping = time.monotonic() + self._interval
                watch = dialed.watch
                if watch.read() and time.monotonic() - warned >= _PROXY_HANDSHAKE_WARN_EVERY_S:
                    warned = time.monotonic()
                    logger.warning(
                        "proxy registration to %s: %s; no ping reaches the proxy (this side "
                        "signs them: %s)",
                        self._endpoint,
                        watch.reason,
                        "yes" if self._auth.enabled else "no",
                    )
                if watch.ended and not self._stop.wait(_PROXY_REDIAL_S):
                    # ZMQ gave the connection up for good (a protocol failure): dial again, so
                    # that a proxy restarted with the matching configuration is found.
                    dialed.close(0)
                    redialled = self._dial_until_stopped()
                    if redialled is None:
                        return  # stopped (the finally closes the closed one again: harmless)
                    dialed = redialled
                    continue
                # In slices: the handshake failures are read as they come, whatever the interval.
                self._stop.wait(min(1.0, max(0.0, next_ping - time.monotonic())))
        finally:
            dialed.close(0)

    def _ping(self, sock: zmq.Socket) -> None:
        try:
            sock.send_multipart(self._auth.seal_registration(self._payload), flags=zmq.NOBLOCK)
            with self._lock:
                self._sent += 1
        except zmq.Again:
            logger.debug("proxy %s not reachable yet; ping skipped", self._endpoint)
        except zmq.ZMQError as exc:
            logger.warning("proxy ping to %s failed: %s", self._endpoint, exc)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop pinging and join the thread (at most ``timeout`` s). Idempotent."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> ProxyPinger:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


__all__ = [
    "ChecksumAtOnce",
    "ChecksumProvider",
    "ChecksumReadiness",
    "HandshakeServer",
    "MetadataProvider",
    "NotifyListener",
    "NotifySender",
    "PolledRequests",
    "ProxyPinger",
    "RateLimitedWarnings",
    "RequestDone",
    "ask_checksums",
    "fetch_metadata",
    "zmq_endpoint",
]
