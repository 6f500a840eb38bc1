"""Thread pools whose threads never hold up the process's exit.

A ``concurrent.futures.ThreadPoolExecutor`` joins its workers when the interpreter exits, after
they ran every task still queued: a pool whose tasks wait on the network (a handshake with a
peer that stopped answering, a check with a stalled prefill: up to ``transfer_timeout`` each)
held a process's exit that long, batch after batch, and for ever behind a task that never
ends. A :class:`DaemonPool`'s threads are daemons: the process exits when its main thread
does, whatever they are doing. It offers the part of the executor's interface the package
uses (``submit`` returning a ``Future``, ``shutdown`` that cancels what is queued).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

_T = TypeVar("_T")

_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class DaemonPool:
    """Up to ``threads`` daemon threads named ``<name>-<i>`` that run the tasks submitted, in
    order: started as tasks come, or all at once with ``start_now`` (then :meth:`submit`
    never starts a thread, so it may be called under a caller's lock). Thread-safe."""

    def __init__(self, threads: int, name: str, *, start_now: bool = False) -> None:
        """Raises RuntimeError when ``start_now`` and a thread cannot be started (those
        started then end)."""
        if threads < 1:
            raise ValueError(f"{name}: threads must be >= 1, got {threads}")
        self._size = threads
        self._name = name
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._shut = False
        if start_now:
            try:
                with self._lock:
                    while self._started < self._size:
                        self._start_thread()
            except BaseException:
                self.shutdown()
                raise

    @property
    def queued(self) -> int:
        """Tasks waiting for a thread now (approximate while threads take them)."""
        return self._tasks.qsize()

    def submit(self, fn: Callable[..., _T], /, *args: Any) -> Future[_T]:
        """Queue ``fn(*args)``; its future gets what it returns or raises. Raises RuntimeError
        once shut down (as an executor does), or when no thread runs and none can start."""
        future: Future[_T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._name}: cannot take tasks after shutdown")
            if self._started < self._size:
                try:
                    self._start_thread()
                except RuntimeError:
                    if self._started == 0:
                        raise  # nothing would ever run it
            self._tasks.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Take no more tasks and cancel those queued; a running one finishes on its own
        (nothing waits for it). Idempotent."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
            while True:
                try:
                    task = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task[0].cancel()
            for _ in range(self._started):
                self._tasks.put(None)

    def _start_thread(self) -> None:
        """One more thread (the lock held)."""
        thread = threading.Thread(
            target=self._work, name=f"{self._name}-{self._started}", daemon=True
        )
        thread.start()
        self._started += 1

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)


__all__ = ["DaemonPool"]
