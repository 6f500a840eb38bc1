"""DaemonPool: the executor subset the package uses, on threads that never hold up the exit."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import CancelledError

import pytest

from moriio_native.pools import DaemonPool
from process_support import run_exiting

WAIT_S = 10.0


def test_tasks_run_in_order_and_their_futures_get_results_and_errors() -> None:
    pool = DaemonPool(1, "test-pool")
    try:
        ran: list[int] = []
        futures = [pool.submit(ran.append, i) for i in range(5)]
        failed = pool.submit(int, "not a number")
        assert [f.result(WAIT_S) for f in futures] == [None] * 5
        assert ran == [0, 1, 2, 3, 4]
        with pytest.raises(ValueError, match="not a number"):
            failed.result(WAIT_S)
    finally:
        pool.shutdown()


def test_shutdown_cancels_what_is_queued_and_refuses_more() -> None:
    pool = DaemonPool(1, "test-pool")
    started, release = threading.Event(), threading.Event()
    running = pool.submit(lambda: (started.set(), release.wait(WAIT_S))[1])
    queued = pool.submit(lambda: "never")
    assert started.wait(WAIT_S)
    assert pool.queued == 1
    pool.shutdown()
    pool.shutdown()  # idempotent
    with pytest.raises(CancelledError):
        queued.result(WAIT_S)
    assert pool.queued == 1  # the running thread's end-of-work marker
    with pytest.raises(RuntimeError, match="test-pool: cannot take tasks after shutdown"):
        pool.submit(lambda: None)
    release.set()
    assert running.result(WAIT_S) is True  # a running task finishes on its own


def test_threads_start_as_tasks_come_or_all_at_once() -> None:
    def pool_threads(name: str) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith(f"{name}-")]

    lazy = DaemonPool(3, "test-lazy")
    eager = DaemonPool(3, "test-eager", start_now=True)
    try:
        assert pool_threads("test-lazy") == []
        assert len(pool_threads("test-eager")) == 3
        assert all(t.daemon for t in pool_threads("test-eager"))
        lazy.submit(lambda: None).result(WAIT_S)
        assert len(pool_threads("test-lazy")) == 1
    finally:
        lazy.shutdown()
        eager.shutdown()
    for thread in pool_threads("test-lazy") + pool_threads("test-eager"):
        thread.join(WAIT_S)
        assert not thread.is_alive()


def test_a_task_that_never_ends_does_not_hold_up_the_process_exit(tmp_path) -> None:
    """A ThreadPoolExecutor's workers are joined at exit: a handshake or a check waiting on a
    peer that stopped answering held the process that long (for ever here)."""
    done = run_exiting(
        tmp_path / "exits.py",
        """
            import threading
            from moriio_native.pools import DaemonPool

            started = threading.Event()
            pool = DaemonPool(2, "stuck")
            pool.submit(lambda: (started.set(), threading.Event().wait()))
            pool.submit(threading.Event().wait)  # queued behind nothing: the second thread
            assert started.wait(10)
            print("exiting", flush=True)
            """,
    )
    assert "exiting" in done.stdout


def test_at_exit_the_running_task_of_a_computing_pool_finishes_and_the_queued_are_cancelled(
    tmp_path,
) -> None:
    """A pool given ``exit_wait_s`` lets its running task finish at exit (a daemon thread still
    inside native code that released the GIL when the interpreter finalizes can abort the
    process: a checksum through torch did) and cancels what is queued behind it."""
    out = tmp_path / "out.txt"
    run_exiting(
        tmp_path / "exits.py",
        f"""
            import threading, time
            from moriio_native.pools import DaemonPool

            started = threading.Event()

            def compute(text):
                started.set()
                while not pool._workers.shut:  # until the exit cancelled what is queued
                    time.sleep(0.01)
                time.sleep(0.2)  # then still computing: the exit waits for it
                with open({str(out)!r}, "a") as f:
                    f.write(text)

            pool = DaemonPool(1, "computing", exit_wait_s=10.0)
            pool.submit(compute, "running ")
            pool.submit(compute, "queued ")
            assert started.wait(10)
            """,
    )
    assert out.read_text() == "running "


def test_an_unused_pool_is_collected_and_its_threads_end() -> None:
    """The threads hold only what they share with the pool, not the pool: one dropped without
    a shutdown (a test's, a tool's) is collected and its threads end."""
    pool = DaemonPool(2, "test-dropped", start_now=True)
    pool.submit(lambda: None).result(WAIT_S)
    threads = [t for t in threading.enumerate() if t.name.startswith("test-dropped-")]
    assert len(threads) == 2
    del pool
    gc.collect()
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()


def test_a_forked_child_exits_though_its_parent_held_a_pools_locks_at_the_fork(tmp_path) -> None:
    """A child forked while a thread of its parent held a pool's locks (a submit, the exit's
    list of pools) inherits them held, with no thread to release them: neither its exit nor
    the collection of its copy of the pool may touch them (it waited for ever on the pool's),
    and a task submitted there is refused (the pool's threads are the parent's: it would
    never run)."""
    run_exiting(
        tmp_path / "forks.py",
        """
            import gc, os, signal, sys, threading, time
            from moriio_native import pools
            from moriio_native.pools import DaemonPool

            pool = DaemonPool(1, "forked", exit_wait_s=10.0)
            held, release = threading.Event(), threading.Event()

            def hold():
                with pool._workers.lock, pools._AT_EXIT_LOCK:
                    held.set()
                    release.wait()

            threading.Thread(target=hold, daemon=True).start()
            assert held.wait(10)
            child = os.fork()
            if child == 0:
                try:
                    pool.submit(print, "never runs: the pool's threads are the parent's")
                    os._exit(3)
                except RuntimeError:
                    pass
                del pool  # collected here: the parent's threads are not the child's to end
                gc.collect()
                sys.exit(0)  # a normal exit: the atexit hooks run
            release.set()
            deadline = time.monotonic() + 10
            while (ended := os.waitpid(child, os.WNOHANG)) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(child, signal.SIGKILL)
                    sys.exit("the child hung")
                time.sleep(0.05)
            assert os.waitstatus_to_exitcode(ended[1]) == 0, ended
            """,
    )


def test_a_done_callback_that_submits_while_the_pool_shuts_down_does_not_deadlock() -> None:
    """Cancelling a queued task runs its done callbacks: one that submits to the same pool
    waited for ever on the lock the shutdown held (and so did the process's exit)."""
    pool = DaemonPool(1, "test-callback")
    release = threading.Event()
    pool.submit(release.wait, WAIT_S)
    refused: list[BaseException] = []

    def submit_again(_future: object) -> None:
        try:
            pool.submit(lambda: None)
        except RuntimeError as exc:
            refused.append(exc)

    pool.submit(lambda: None).add_done_callback(submit_again)
    shutting = threading.Thread(target=pool.shutdown, daemon=True)
    shutting.start()
    shutting.join(WAIT_S)
    release.set()
    assert not shutting.is_alive(), "shutdown waits on its own lock"
    assert refused and "after shutdown" in str(refused[0])
