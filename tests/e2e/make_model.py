"""Builds the end-to-end tier's tiny models locally: no model hub.

A 4-layer Llama (``--arch llama``, the default) or a 4-layer hybrid GraniteMoeHybrid
(``--arch hybrid``: Mamba2, attention, Mamba2, attention, with a dense MLP -- vLLM gives it a
Mamba state KV-cache group and a full-attention one) with random weights
(``torch.manual_seed(seed)``) and a byte-level BPE tokenizer trained with ``tokenizers`` on
generated text (fixed seed), saved as a Hugging Face model directory that ``vllm serve`` loads.
Two directories built with different ``--seed`` share the architecture and the tokenizer and
differ only in their weights (the negative control's prefill serves the other one).

    python tests/e2e/make_model.py OUT_DIR [--arch llama|hybrid] [--seed 0] [--tokenizer-from DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

VOCAB_SIZE = 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_TEXT = (
    "the cache moves blocks from prefill to decode while layers wait for bytes and every "
    "request keeps its tokens in order so the model can read keys values heads and pages "
    "quickly across hosts over shared memory networks engines ports peers"
)


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    words = _TEXT.split()
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(4, 24)))
        + rng.choice((".", "?", "!", ",", ";"))
        + f" {rng.randint(0, 9999)}"
        for _ in range(lines)
    ]


def build_tokenizer(out: Path) -> None:
    """Train a byte-level BPE tokenizer of VOCAB_SIZE tokens and save it in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(1234), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 1024,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )


_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    # Larger than the default 0.02: greedy output then varies token by token and changes
    # when any block of the prompt changes, instead of repeating one token.
    "initializer_range": 0.1,
    "torch_dtype": "float32",
}
ARCHS = ("llama", "hybrid")


def build_model(out: Path, seed: int, arch: str = "llama") -> None:
    """Random-weight model of ``arch`` (float32) saved in ``out``: LlamaForCausalLM, or
    GraniteMoeHybridForCausalLM with Mamba2 layers 0 and 2 and attention layers 1 and 3 (no
    experts: its shared MLP is the dense MLP)."""
    import torch
    import transformers

    if arch == "llama":
        model_cls, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(**_COMMON)
    elif arch == "hybrid":
        model_cls = transformers.GraniteMoeHybridForCausalLM
        config = transformers.GraniteMoeHybridConfig(
            **_COMMON,
            shared_intermediate_size=_COMMON["intermediate_size"],
            num_local_experts=0,
            num_experts_per_tok=0,
            layer_types=["mamba", "attention", "mamba", "attention"],
            position_embedding_type="rope",
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=1,
            mamba_chunk_size=64,
        )
    else:
        raise ValueError(f"unknown architecture {arch!r}: one of {ARCHS}")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="model architecture")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    parser.add_argument(
        "--tokenizer-from", type=Path, help="copy the tokenizer of this model directory"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    build_model(args.out, args.seed, args.arch)
    if args.tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            shutil.copy(args.tokenizer_from / name, args.out / name)
    else:
        build_tokenizer(args.out)


if __name__ == "__main__":
    main()
