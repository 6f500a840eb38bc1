"""The package's records under vLLM's logging (moriio_native.vllm.use_vllm_logging): at vLLM's
level by default, at MORIIO_NATIVE_LOG_LEVEL alone when it is set (the WRITE jobs' DEBUG
steps without vLLM's own debug output)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from moriio_native.vllm import ENV_LOG_LEVEL, use_vllm_logging


class Collect(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def vllm_handler(monkeypatch: pytest.MonkeyPatch) -> Iterator[Collect]:
    """vLLM's handler at INFO, and the package's logger as it is before the connector loads;
    both restored after."""
    ours = logging.getLogger("moriio_native")
    saved = (ours.handlers[:], ours.level, ours.propagate)
    ours.handlers.clear()
    ours.setLevel(logging.NOTSET)
    vllm = logging.getLogger("vllm")
    handler = Collect(logging.INFO)
    vllm.addHandler(handler)
    monkeypatch.delenv(ENV_LOG_LEVEL, raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    yield handler
    vllm.removeHandler(handler)
    ours.handlers[:], ours.level, ours.propagate = saved[0], saved[1], saved[2]


def test_the_package_takes_vllms_level_by_default(vllm_handler: Collect) -> None:
    use_vllm_logging()
    log = logging.getLogger("moriio_native.pd.pusher")
    log.debug("a debug line")
    log.info("an info line")
    assert vllm_handler.messages == ["an info line"]


def test_its_own_level_shows_its_debug_lines_through_vllms_handler(
    vllm_handler: Collect, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_LOG_LEVEL, "debug")
    use_vllm_logging()
    logging.getLogger("moriio_native.pd.pusher").debug("WRITE %s: a step", "tx-1")
    logging.getLogger("vllm.other").debug("vLLM's own debug line")
    assert vllm_handler.messages == ["WRITE tx-1: a step"]


def test_a_level_that_is_none_is_refused_naming_the_variable(
    vllm_handler: Collect, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_LOG_LEVEL, "loud")
    with pytest.raises(ValueError, match="MORIIO_NATIVE_LOG_LEVEL='LOUD' is not a logging level"):
        use_vllm_logging()
    ours = logging.getLogger("moriio_native")
    assert ours.level == logging.NOTSET and not ours.handlers
