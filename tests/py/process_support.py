"""A child process a test drives through a Pipe: it sends one answer first (e.g. its metadata),
then one per command; an exception it sends back is raised here. Spawned, so the child imports
the test's module afresh (no state inherited from the test process). And :func:`run_exiting`:
a script run to its end, for what happens when a process exits; :func:`wait_for`: a condition
another thread or process brings about, polled to a limit."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: How long a script run by :func:`run_exiting` may take to exit (a hang guard).
EXIT_TIMEOUT_S = 30.0


def run_exiting(path: Path, source: str) -> subprocess.CompletedProcess[str]:
    """Write ``source`` (dedented) to ``path`` and run it with this interpreter and import
    path; its result once it exited (rc 0 asserted, with its stderr), or TimeoutExpired (the
    process killed) when it has not exited within EXIT_TIMEOUT_S."""
    path.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=EXIT_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr
    return done


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


def wait_for(cond: Callable[[], bool], what: str, limit: float = 20.0) -> None:
    """Poll ``cond`` until it holds; AssertionError naming ``what`` after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)
