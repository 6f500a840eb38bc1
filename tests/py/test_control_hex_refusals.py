"""A refusal must say what was wrong. kv_transfer_params'
``remote_prompt_digest`` and ``remote_answer_tag`` must be 64 lower-case hex characters, but a
value failing that (upper-case hex, a truncated tag) was refused with "expected printable
characters only" -- false for the value shown (it is printable), so an operator debugging a
proxy that re-cases or cuts the tag was sent the wrong way (schema.explain() mapped every
pattern it did not know to the printable-text reason)."""

from __future__ import annotations

import pytest

from moriio_native.control.addressing import parse_kv_transfer_params
from moriio_native.errors import InvalidArgumentError


@pytest.mark.parametrize("key", ["remote_answer_tag", "remote_prompt_digest"])
@pytest.mark.parametrize("value", ["AB" * 32, "ab" * 31 + "a"])
def test_a_malformed_hex_value_is_refused_naming_the_hex_rule(key: str, value: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_kv_transfer_params({"transfer_id": "tx", key: value})
    text = str(caught.value)
    assert key in text, text
    assert "printable" not in text, text  # the value is printable: that is not what is wrong
    assert "hex" in text, text
