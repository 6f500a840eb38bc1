"""The tests' port picker: a port it hands out is not handed out again while its listener may
still be about to bind it (an end-to-end run once gave the proxy's port to a prefill picked
after it)."""

from __future__ import annotations

import itertools
import socket

import pytest

import net_support


@pytest.fixture
def four_ports(monkeypatch: pytest.MonkeyPatch) -> range:
    """The picker confined to four ports that can all be bound now, with nothing remembered."""
    for low in range(net_support._LOW, net_support._HIGH - 4, 4):
        candidates = range(low, low + 4)
        if all(_bindable(port) for port in candidates):
            break
    else:
        pytest.skip("no four consecutive bindable ports")
    monkeypatch.setattr(net_support, "_LOW", candidates.start)
    monkeypatch.setattr(net_support, "_HIGH", candidates.stop)
    monkeypatch.setattr(net_support, "_handed_out", {}, raising=False)
    return candidates


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound(four_ports: range) -> None:
    picked = [net_support.free_port() for _ in range(4)]
    assert sorted(picked) == list(four_ports)
    with pytest.raises(RuntimeError, match="4 handed out recently"):
        net_support.free_port()


def test_blocks_of_ports_never_overlap(four_ports: range) -> None:
    handed: list[int] = []
    for _ in range(10):
        try:
            base = net_support.free_ports(2)
        except RuntimeError as refused:
            assert "no 2 consecutive bindable ports" in str(refused)
            break
        handed.extend((base, base + 1))
    assert 2 <= len(handed) <= 4
    assert len(set(handed)) == len(handed)


def test_a_port_someone_listens_on_is_not_handed_out(four_ports: range) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", four_ports.start))
        picked = {net_support.free_port() for _ in range(3)}
    assert picked == set(four_ports[1:])


def test_only_recent_ports_are_remembered(
    four_ports: range, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(net_support, "_REMEMBERED", 2, raising=False)
    picked = [net_support.free_port() for _ in range(6)]
    assert set(picked) <= set(four_ports)
    assert all(a != b for a, b in itertools.pairwise(picked))
    assert len(net_support._handed_out) == 2
