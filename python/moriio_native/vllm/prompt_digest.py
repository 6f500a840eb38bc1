"""A digest of what a prompt's first positions are, as both instances of a P/D pair see them.

The prefill's answer names blocks, and the KV in them is that of the prompt the prefill
computed. A decode that loads them for its own prompt must be serving the same prompt over the
positions it loads: a client's own params pairing a genuine answer with another prompt (or two
instances that tokenize differently) would otherwise have the decode take one prompt's KV as
another's, and keep it in its prefix cache under the other prompt's tokens. The prefill states
:func:`prompt_digest` over the tokens it computed (``remote_prompt_digest``, under the answer's
tag), and the decode compares it with its own over the same positions.

What decides a position's KV goes in: the token id (-1 for a position given as an embedding;
the embedding values are not covered), the multimodal items starting before the end (position,
length, modality and vLLM's identifier of the item), the prefix cache salt and the LoRA
adapter's name. vLLM derives an item's identifier from its content, the served model's name
and the hasher (``mm_hasher_algorithm``): instances that serve the model under different names
(a local path on one, a hub id on the other) give every multimodal prompt different digests,
and such requests are then computed locally, never loaded from another item's KV.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec
import numpy as np

if TYPE_CHECKING:
    from vllm.v1.request import Request

_DOMAIN = b"moriio-native/prompt/v1\x00"
# A position given as an embedding (a prompt of embeddings, or one position of a mixed prompt).
_EMBEDDED = -1


def prompt_digest(request: Request, num_tokens: int) -> str:
    """Hex SHA-256 of the request's first ``num_tokens`` prompt positions (see the module
    docstring); ValueError when its prompt has fewer."""
    if num_tokens > request.num_prompt_tokens:
        raise ValueError(
            f"request {request.request_id}: a digest of {num_tokens} positions, its prompt has "
            f"{request.num_prompt_tokens}"
        )
    ids = _position_ids(request, num_tokens)
    items = sorted(
        (f.mm_position.offset, f.mm_position.length, f.modality, f.identifier)
        for f in request.mm_features
        if f.mm_position.offset < num_tokens
    )
    lora = request.lora_request.lora_name if request.lora_request is not None else None
    digest = hashlib.sha256(_DOMAIN)
    digest.update(msgspec.msgpack.encode((num_tokens, request.cache_salt, lora, items)))
    digest.update(ids.tobytes())
    return digest.hexdigest()


def _position_ids(request: Request, num_tokens: int) -> np.ndarray:
    """The first ``num_tokens`` token ids, little-endian int64, -1 where a position is given as
    an embedding."""
    if request.prompt_token_ids is None:
        return np.full(num_tokens, _EMBEDDED, dtype="<i8")
    ids = np.asarray(request.prompt_token_ids[:num_tokens], dtype="<i8")
    if request.prompt_is_token_ids is not None:
        is_token = np.asarray(request.prompt_is_token_ids[:num_tokens], dtype=bool)
        ids = np.where(is_token, ids, _EMBEDDED).astype("<i8")
    return ids


__all__ = ["prompt_digest"]
