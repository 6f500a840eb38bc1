"""Thread pools whose threads hold up the process's exit only as long as their owner allows.

A ``concurrent.futures.ThreadPoolExecutor`` joins its workers when the interpreter exits, after
they ran every task still queued: a pool whose tasks wait on the network (a handshake with a
peer that stopped answering, a check with a stalled prefill: up to ``transfer_timeout`` each)
held a process's exit that long, batch after batch, and for ever behind a task that never
ends. A :class:`DaemonPool`'s threads are daemons. At exit (``atexit``, while threads still
run) its queued tasks are cancelled and the running ones are waited for up to ``exit_wait_s``
(0: not at all): a pool whose tasks compute in native code that releases the GIL (a checksum
through torch) gives them that long, since a daemon thread still inside such code when the
interpreter finalizes is stopped where it takes the GIL back, which inside a C++ destructor
aborts the process. It offers the part of the executor's interface the package uses
(``submit`` returning a ``Future``, ``shutdown`` that cancels what is queued).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

_T = TypeVar("_T")

logger = logging.getLogger("moriio_native.pools")

#: ``exit_wait_s`` for pools whose tasks compute checksums (a long prompt's blocks on a host
#: take about a second): at exit, what they are computing is finished, not cut.
COMPUTING_EXIT_WAIT_S = 10.0

_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class _Workers:
    """What a pool's threads share with it (they hold no reference to the pool itself, so an
    unused pool is collected and its threads told to end)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid = os.getpid()  # a forked child's copy has none of these threads
        self.tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)  # notified when a task ends
        self.started = 0
        # Tasks submitted and not ended: queued, taken by a thread, or running (counted from
        # the submit, so that no moment between a thread's take and its run escapes the exit's
        # wait).
        self.outstanding = 0
        self.shut = False

    def shutdown(self) -> None:
        """Take no more tasks, cancel those queued, and tell the threads to end. Idempotent;
        nothing in a forked child (its lock may be held for ever, taken by a thread of the
        parent at the fork)."""
        if self.pid != os.getpid():
            return
        cancelled = []
        with self.lock:
            if self.shut:
                return
            self.shut = True
            while True:
                try:
                    task = self.tasks.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    cancelled.append(task[0])
                    self.outstanding -= 1
            self.idle.notify_all()
            for _ in range(self.started):
                self.tasks.put(None)
        for future in cancelled:  # its callbacks may submit: not under the lock
            future.cancel()

    def wait_running(self, deadline: float) -> None:
        """Wait until no task is outstanding (after :meth:`shutdown`: none runs), or
        ``deadline`` (monotonic) passes."""
        with self.idle:
            while self.outstanding > 0 and (left := deadline - time.monotonic()) > 0:
                self.idle.wait(left)

    def work(self) -> None:
        while (task := self.tasks.get()) is not None:
            future, fn, args = task
            del task  # an idle thread keeps nothing of its last task alive
            try:
                if future.set_running_or_notify_cancel():
                    _run(future, fn, args)
            finally:
                with self.idle:
                    self.outstanding -= 1
                    self.idle.notify_all()
            del future, fn, args


def _run(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Run ``fn(*args)`` into ``future``. What its done callbacks raise past the future's own
    guard (a BaseException) is logged: the thread must live on for the pool's next task."""
    try:
        try:
            result = fn(*args)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except BaseException:
        logger.exception("a done callback of a pool task raised")


# Pools to settle at exit, each with the longest its running tasks are waited for then.
_AT_EXIT: weakref.WeakKeyDictionary[DaemonPool, float] = weakref.WeakKeyDictionary()
_AT_EXIT_LOCK = threading.Lock()


def _settle_at_exit() -> None:
    """Cancel every pool's queued tasks, then wait (all pools at once) for their running ones,
    each pool at most its ``exit_wait_s``."""
    with _AT_EXIT_LOCK:
        # A forked child's copies of its parent's pools have no threads here to wait for.
        pid = os.getpid()
        pools = [(pool, wait_s) for pool, wait_s in _AT_EXIT.items() if pool._workers.pid == pid]
    start = time.monotonic()
    for pool, _ in pools:
        pool.shutdown()
    for pool, wait_s in pools:
        pool._workers.wait_running(start + wait_s)


def _after_fork_in_child() -> None:
    """A thread of the parent may have held the lock at the fork: the child's is a new one."""
    global _AT_EXIT_LOCK
    _AT_EXIT_LOCK = threading.Lock()


atexit.register(_settle_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)


class DaemonPool:
    """Up to ``threads`` daemon threads named ``<name>-<i>`` that start the tasks submitted in
    order: started as tasks come, or all at once with ``start_now`` (then :meth:`submit`
    never starts a thread, so it may be called under a caller's lock). At the process's exit
    the queued tasks are cancelled and the running ones waited for up to ``exit_wait_s``
    (module docstring). Thread-safe."""

    def __init__(
        self, threads: int, name: str, *, start_now: bool = False, exit_wait_s: float = 0.0
    ) -> None:
        """Raises RuntimeError when ``start_now`` and a thread cannot be started (those
        started then end)."""
        if threads < 1:
            raise ValueError(f"{name}: threads must be >= 1, got {threads}")
        self._size = threads
        self._workers = _Workers(name)
        # An unused pool's threads end with it (they hold only its _Workers). Not at exit:
        # _settle_at_exit does it for this process's pools, and a forked child's copy of its
        # parent's pool may have its lock held for ever (taken by a thread at the fork).
        weakref.finalize(self, self._workers.shutdown).atexit = False
        if start_now:
            try:
                with self._workers.lock:
                    while self._workers.started < self._size:
                        self._start_thread()
            except BaseException:
                self.shutdown()
                raise
        with _AT_EXIT_LOCK:
            _AT_EXIT[self] = exit_wait_s

    @property
    def queued(self) -> int:
        """Tasks waiting for a thread now (approximate while threads take them)."""
        return self._workers.tasks.qsize()

    def submit(self, fn: Callable[..., _T], /, *args: Any) -> Future[_T]:
        """Queue ``fn(*args)``; its future gets what it returns or raises. Raises RuntimeError
        once shut down (as an executor does), or when no thread runs and none can start."""
        future: Future[_T] = Future()
        workers = self._workers
        if workers.pid != os.getpid():
            raise RuntimeError(f"{workers.name}: a pool of the parent process (forked), not ours")
        with workers.lock:
            if workers.shut:
                raise RuntimeError(f"{workers.name}: cannot take tasks after shutdown")
            if workers.started < self._size:
                try:
                    self._start_thread()
                except RuntimeError:
                    if workers.started == 0:
                        raise  # nothing would ever run it
            workers.outstanding += 1
            workers.tasks.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Take no more tasks and cancel those queued; a running one finishes on its own
        (nothing waits for it). Idempotent."""
        self._workers.shutdown()

    def _start_thread(self) -> None:
        """One more thread (the workers' lock held)."""
        workers = self._workers
        thread = threading.Thread(
            target=workers.work, name=f"{workers.name}-{workers.started}", daemon=True
        )
        thread.start()
        workers.started += 1


def when_cancelled(task: Future[Any], dropped: Callable[[], None]) -> None:
    """Call ``dropped`` if the pool cancels ``task`` unrun (shut down while it was queued):
    whatever the task would have completed or answered is then completed by ``dropped``, never
    left pending."""
    task.add_done_callback(lambda t: dropped() if t.cancelled() else None)


__all__ = ["COMPUTING_EXIT_WAIT_S", "DaemonPool", "when_cancelled"]
