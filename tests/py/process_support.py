"""A child process a test drives through a Pipe: it sends one answer first (e.g. its metadata),
then one per command; an exception it sends back is raised here. Spawned, so the child imports
the test's module afresh (no state inherited from the test process)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any


class PipeChild:
    """Runs ``target(conn, *args)`` in a spawned process; ``timeout`` bounds every answer (a hang
    guard, not a performance bound)."""

    def __init__(self, name: str, target: Callable[..., None], args: tuple, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
        self.proc.start()
        child_conn.close()
        self.name = name
        self.timeout = timeout

    def answer(self) -> Any:
        if not self.conn.poll(self.timeout):
            raise TimeoutError(f"{self.name} did not answer")
        out = self.conn.recv()
        if isinstance(out, BaseException):
            raise out
        return out

    def call(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        return self.answer()

    def stop(self) -> int | None:
        """Asks the child to quit (the command "quit"), waits for it; its exit code."""
        if self.proc.is_alive():
            self.call("quit")
        self.proc.join(self.timeout)
        return self.proc.exitcode
