"""The digest of a prompt's first positions that a prefill's answer states and a READ decode
compares (vllm/prompt_digest.py): equal for what both instances see alike, different for
anything that changes a position's KV."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from moriio_native.vllm.prompt_digest import prompt_digest


def as_request(
    rid: str,
    prompt: list[int] | None,
    *,
    num_prompt_tokens: int | None = None,
    is_token: list[bool] | None = None,
    mm: tuple[tuple[int, int, str, str], ...] = (),
    cache_salt: str | None = None,
    lora: str | None = None,
) -> Any:
    """What prompt_digest reads of a vLLM Request."""
    features = [
        SimpleNamespace(
            mm_position=SimpleNamespace(offset=offset, length=length),
            modality=modality,
            identifier=identifier,
        )
        for offset, length, modality, identifier in mm
    ]
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=prompt,
        prompt_is_token_ids=is_token,
        num_prompt_tokens=len(prompt) if num_prompt_tokens is None else num_prompt_tokens,
        mm_features=features,
        cache_salt=cache_salt,
        lora_request=None if lora is None else SimpleNamespace(lora_name=lora),
    )


@dataclasses.dataclass
class Change:
    what: str
    request: Any


PROMPT = list(range(3, 43))
BASE = as_request("r", PROMPT, mm=((4, 8, "image", "img-a"),))


@pytest.mark.parametrize(
    "change",
    [
        Change("another token", as_request("r", [*PROMPT[:-1], 7], mm=((4, 8, "image", "img-a"),))),
        Change("another image", as_request("r", PROMPT, mm=((4, 8, "image", "img-b"),))),
        Change("an image elsewhere", as_request("r", PROMPT, mm=((5, 8, "image", "img-a"),))),
        Change("no image", as_request("r", PROMPT)),
        Change(
            "a cache salt",
            as_request("r", PROMPT, mm=((4, 8, "image", "img-a"),), cache_salt="s"),
        ),
        Change("a LoRA adapter", as_request("r", PROMPT, mm=((4, 8, "image", "img-a"),), lora="x")),
        Change(
            "a position given as an embedding",
            as_request("r", PROMPT, mm=((4, 8, "image", "img-a"),), is_token=[True] * 39 + [False]),
        ),
    ],
    ids=lambda c: c.what,
)
def test_anything_that_changes_a_positions_kv_changes_the_digest(change: Change) -> None:
    assert prompt_digest(change.request, 40) != prompt_digest(BASE, 40)


def test_only_the_positions_asked_for_count() -> None:
    """The decode's prompt is the prefill's and more (the tokens the prefill's backoff left to
    the decode): the digest over the prefill's positions is the prefill's, whatever follows,
    and an image starting after them is not covered."""
    longer = as_request(
        "d", [*PROMPT, 99, 98], mm=((4, 8, "image", "img-a"), (40, 2, "image", "img-z"))
    )
    assert prompt_digest(longer, 40) == prompt_digest(BASE, 40)
    assert prompt_digest(longer, 41) != prompt_digest(BASE, 40)


def test_a_prompt_of_embeddings_is_digested_by_its_length() -> None:
    """No token ids at all: only the positions' count (and the salt, LoRA, images) can be
    compared; the embeddings' values are not covered."""
    embedded = as_request("e", None, num_prompt_tokens=40)
    assert prompt_digest(embedded, 40) == prompt_digest(
        as_request("f", None, num_prompt_tokens=40), 40
    )
    assert prompt_digest(embedded, 40) != prompt_digest(as_request("r", PROMPT), 40)


def test_more_positions_than_the_prompt_has_are_refused_naming_the_request() -> None:
    with pytest.raises(ValueError, match="request r: a digest of 41 positions, its prompt has 40"):
        prompt_digest(as_request("r", PROMPT), 41)
