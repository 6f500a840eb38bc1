"""The tier's fixed greedy requests: token-id prompts, so their lengths are exact.

Lengths sit around the 32-token block boundary (31, 32, 33, 64, 65), span several blocks (150,
200), and two pairs share a 96-token prefix so the decode's own prefix cache serves the shared
blocks of the second request of a pair (only the rest moves). The negative-control set is a
second, disjoint set of the same shape: the decode has cached none of it.
"""

from __future__ import annotations

import os
import random

VOCAB = 1024
FIRST_ID = 2  # 0 and 1 are <s> and </s>
MAX_TOKENS = 12
_LENGTHS = (31, 32, 33, 64, 65, 150, 200)
_SHARED_PREFIX = 96
_TAILS = (10, 40)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


def prompt_set(seed: int) -> list[list[int]]:
    """The tier's prompts for ``seed``: the lengths above, then the shared-prefix requests."""
    rng = random.Random(seed)
    prompts = [_ids(rng, n) for n in _LENGTHS]
    prefix = _ids(rng, _SHARED_PREFIX)
    prompts += [prefix + _ids(rng, n) for n in _TAILS]
    return prompts


def fault_round(index: int) -> tuple[list[int], list[list[int]]]:
    """Round ``index`` of the fault scenarios (tests/e2e/test_serve_faults.py): the request the
    fault hits (400 tokens: a prefill long enough to be caught running) and two fresh requests
    sent after it (no decode has cached any of them)."""
    rng = random.Random(1000 + index)
    return _ids(rng, 400), [_ids(rng, 40), _ids(rng, 170)]


# Scenarios of test_serve_faults.py that take rounds of prompts.fault_round (each its own
# range, so no round's requests are cached on the decode before it runs).
FAULT_SCENARIOS = 4


def fault_rounds() -> int:
    """Rounds of each fault scenario: ``MORIIO_E2E_FAULT_ROUNDS`` (scripts/reliability.sh's
    serve tier), else the CI tier's 2."""
    return int(os.environ.get("MORIIO_E2E_FAULT_ROUNDS") or 2)


MAIN = prompt_set(13)
NEGATIVE = prompt_set(14)
# Fresh to both instances when vllm-router sends them, so every one is loaded from the prefill.
ROUTER = prompt_set(15)
# Sent straight to each instance once it is healthy (serving.Instance.wait_ready), never through
# a router, so it moves no KV; its own seed keeps it out of the prefixes of the sets above.
WARM_UP = _ids(random.Random(99), 40)
# Sent once through the fault tier's router before its rounds: the pair's first transfer (UCX's
# connection over TCP, the first region check, on a 2-core machine still busy with the instances'
# start) is then not a round's. Its own seed keeps it out of every round's prefixes.
PD_WARM_UP = _ids(random.Random(98), 40)
