"""Session fixtures of the end-to-end tier, shared by its modules: the work directory, the
tiny models (built once) and the plain instance's completions every P/D answer must equal."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import prompts
import pytest
import serving
from prompts import FAULT_SCENARIOS, fault_rounds
from serving import START_TIMEOUT_S, Completion, Env


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report carries the logs of the servers still up (or died on their own),
    before its fixtures stop them: CI output alone must tell what the instances saw."""
    report = yield
    if report.failed:
        for title, text in serving.failure_logs():
            report.sections.append((title, text))
    return report


@pytest.fixture(scope="session")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    workdir = os.environ.get("MORIIO_E2E_WORKDIR")
    path = Path(workdir) if workdir else tmp_path_factory.mktemp("e2e")
    path.mkdir(parents=True, exist_ok=True)
    made = Env(path)
    yield made
    made.close()


@pytest.fixture(scope="session")
def models(env: Env) -> tuple[Path, Path]:
    """(the served model, the negative control's: same tokenizer, other weights)."""
    right, other = env.workdir / "model-a", env.workdir / "model-b"
    script = Path(__file__).with_name("make_model.py")
    for out, extra in ((right, []), (other, ["--seed", "1", "--tokenizer-from", str(right)])):
        if out.exists():
            shutil.rmtree(out)
        subprocess.run([sys.executable, str(script), str(out), *extra], check=True, timeout=600)
    return right, other


@pytest.fixture(scope="session")
def baseline(env: Env, models: tuple[Path, Path]) -> dict[str, list[Completion]]:
    """The plain instance's completions of the prompt sets: ``main``, ``negative``, ``router``,
    and per
    fault round its faulted request and the two requests after it (``faults``, in the order of
    prompts.fault_round: victim, first, second of round 0, then round 1, ...)."""
    fault_prompts = []
    for i in range(FAULT_SCENARIOS * fault_rounds()):
        victim, after = prompts.fault_round(i)
        fault_prompts += [victim, *after]
    with serving.stack() as st:
        plain = serving.plain_instance(env, models[0])
        st.add(plain.server)
        plain.wait_ready(START_TIMEOUT_S)
        out = {
            name: serving.run_all(plain.url, batch, prompts.MAX_TOKENS)
            for name, batch in (
                ("main", prompts.MAIN),
                ("negative", prompts.NEGATIVE),
                ("router", prompts.ROUTER),
                ("faults", fault_prompts),
            )
        }
    # Token for token: the server must return the generated token ids, all of them.
    for got in out.values():
        assert all(c.token_ids is not None and len(c.token_ids) == prompts.MAX_TOKENS for c in got)
    return out
