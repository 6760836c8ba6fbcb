"""Tiny float32 Hugging Face checkpoints written locally (no download): Llama and Qwen2.

Each folder holds ``config.json``, ``model.safetensors`` (seeded random weights), a
byte-level BPE ``tokenizer.json`` trained here with ``tokenizers`` on a built-in text, and
``tokenizer_config.json`` / ``generation_config.json`` -- what vLLM and ``transformers`` need
to load the model offline. Shapes: hidden 256, 4 layers, 8 query heads over 2 kv heads
(head size 32), intermediate 512, vocabulary 512. Needs ``transformers`` and ``tokenizers``.

>>> from opmux.testing.tiny_models import write_tiny_model   # doctest: +SKIP
>>> write_tiny_model("/tmp/tiny-llama", "llama")               # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

__all__ = ["ARCHITECTURES", "SHAPES", "TRAINING_TEXT", "write_tiny_model", "write_tokenizer"]

SHAPES: Final = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
                 "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 512,
                 "max_position_embeddings": 1024}
"""The model shapes both architectures share."""

ARCHITECTURES: Final = ("llama", "qwen2")
"""The ``kind`` values :func:`write_tiny_model` accepts."""

TRAINING_TEXT: Final = (
    "The quick brown fox jumps over the lazy dog. A paged attention kernel reads keys and "
    "values through a block table. Each layer normalises its input, rotates queries and keys, "
    "attends over the cache and mixes features with a gated activation. Plugins register "
    "providers; a priority list picks one per call and the reference runs when none applies. "
    "Tokens are generated one at a time: prefill fills the cache, decode appends to it. "
    "0123456789 + - * / = ( ) [ ] { } , . ; : ! ? 'quoted' \"double\" new\nlines\tand tabs."
)
"""What the tokenizer is trained on (any UTF-8 text still encodes: byte-level fallback)."""


def write_tokenizer(directory: str | Path, vocab_size: int = SHAPES["vocab_size"]) -> Path:
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` tokens into ``directory``
    (``tokenizer.json`` + ``tokenizer_config.json``); return ``tokenizer.json``'s path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    path = out / "tokenizer.json"
    tok.save(str(path))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>", "model_max_length": SHAPES["max_position_embeddings"],
    }, indent=1))
    return path


def _config(kind: str, vocab_size: int, shapes: dict[str, int]) -> Any:
    import transformers

    common: dict[str, Any] = dict(shapes, vocab_size=vocab_size, rms_norm_eps=1e-6,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
                                  torch_dtype="float32")
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    raise ValueError(f"write_tiny_model: unknown kind {kind!r}; expected one of "
                     f"{sorted(ARCHITECTURES)}")


def write_tiny_model(directory: str | Path, kind: str = "llama", *, seed: int = 0,
                     **shapes: int) -> Path:
    """Write a tiny float32 ``kind`` checkpoint (``"llama"`` or ``"qwen2"``) with its
    tokenizer into ``directory``; return the folder. Same ``seed``, same weights.

    ``shapes`` overrides entries of :data:`SHAPES` (``hidden_size=1024``,
    ``num_hidden_layers=8``, ...) for larger random checkpoints of the same kind.

    :raises ValueError: an unknown ``kind`` or a key that is not in :data:`SHAPES`.
    """
    import torch
    import transformers

    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        raise ValueError(f"write_tiny_model: unknown shape keys {unknown}; expected some of "
                         f"{sorted(SHAPES)}")
    out = Path(directory)
    config = _config(kind, SHAPES["vocab_size"], {**SHAPES, **shapes})  # checks kind first
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    config.vocab_size = vocab
    torch.manual_seed(seed)
    model_cls = (transformers.LlamaForCausalLM if kind == "llama"
                 else transformers.Qwen2ForCausalLM)
    model: Any = model_cls(config)
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():  # wider than the default init: less repetitive output
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(out), safe_serialization=True)
    model.generation_config.save_pretrained(str(out))
    return out
