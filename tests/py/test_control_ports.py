"""The control-plane port formula."""

from __future__ import annotations

import pytest

from moriio_native.control.ports import PortPlan, port_offset, rank_port
from moriio_native.errors import InvalidArgumentError


@pytest.mark.parametrize("dp_size", [1, 2, 3, 8])
@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_every_rank_of_a_grid_gets_its_own_ports(dp_size, tp_size):
    plan = PortPlan(handshake_base=6301, notify_base=61005, dp_size=dp_size, tp_size=tp_size)
    handshake = [plan.handshake_port(d, t) for d in range(dp_size) for t in range(tp_size)]
    notify = [plan.notify_port(d, t) for d in range(dp_size) for t in range(tp_size)]
    assert len(set(handshake)) == dp_size * tp_size
    assert len(set(notify)) == dp_size * tp_size
    assert not set(handshake) & set(notify)
    # The ports form one contiguous block above each base (nothing skipped, nothing reused).
    assert sorted(handshake) == list(range(6301, 6301 + dp_size * tp_size))


def test_listener_and_dialer_agree():
    # The dialer only knows the peer's base port, dp rank, tp rank and tp size; the listener
    # computes its own port from its plan. They must meet on every rank, also for DP>1, TP>1.
    listener = PortPlan(7301, 7501, dp_size=2, tp_size=4)
    for dp_rank, tp_rank, hs, nf in listener.all_ports():
        assert rank_port(7301, dp_rank, tp_rank, tp_size=4) == hs
        assert rank_port(7501, dp_rank, tp_rank, tp_size=4) == nf


def test_docstring_table_values():
    plan = PortPlan(6301, 61005, dp_size=2, tp_size=4)
    assert plan.handshake_port(0, 3) == 6304
    assert plan.handshake_port(1, 0) == 6305
    assert plan.notify_port(1, 3) == 61012


def test_same_as_vllm_where_vllm_is_consistent():
    # vLLM listens on base + dp + tp; that equals ours whenever dp_rank == 0 or tp_size == 1.
    for tp_size in (1, 2, 8):
        for tp_rank in range(tp_size):
            assert port_offset(0, tp_rank, tp_size) == tp_rank
    for dp_rank in range(8):
        assert port_offset(dp_rank, 0, 1) == dp_rank


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((0, 4, 4), "tp_rank 4"),
        ((-1, 0, 4), "dp_rank"),
        ((0, 0, 0), "tp_size"),
        ((2, 0, 1, 2), "dp_rank 2"),
        ((0, True, 2), "tp_rank"),
    ],
)
def test_port_offset_rejects_bad_ranks(args, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        port_offset(*args)


def test_ports_beyond_65535_are_refused():
    with pytest.raises(InvalidArgumentError, match="beyond 65535"):
        rank_port(65535, 0, 1, tp_size=2)
    with pytest.raises(InvalidArgumentError, match="exceeds 65535"):
        PortPlan(65530, 6301, dp_size=2, tp_size=4)


def test_overlapping_ranges_are_refused():
    with pytest.raises(InvalidArgumentError, match="overlap"):
        PortPlan(6301, 6305, dp_size=2, tp_size=4)
    PortPlan(6301, 6309, dp_size=2, tp_size=4)  # adjacent is fine


def test_string_base_ports_from_vllm_config_are_accepted():
    assert PortPlan("6301", "61005").notify_port(0, 0) == 61005
    with pytest.raises(InvalidArgumentError, match="handshake_port"):
        PortPlan("63o1", "61005")
