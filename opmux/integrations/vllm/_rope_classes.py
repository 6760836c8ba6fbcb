"""vLLM's rotary classes that the plugin replaces (a leaf: both the plugin's entry module and
its layer replacements read it)."""

from __future__ import annotations

from typing import Final

__all__ = ["ROPE_CLASSES"]

ROPE_CLASSES: Final = (
    "RotaryEmbedding", "LinearScalingRotaryEmbedding", "DynamicNTKScalingRotaryEmbedding",
    "DynamicNTKAlphaRotaryEmbedding", "NTKScalingRotaryEmbedding", "YaRNScalingRotaryEmbedding",
    "Llama3RotaryEmbedding", "Gemma4RotaryEmbedding",
)
"""vLLM's rotary classes replaced under ``rotary_embedding`` (those that keep
``RotaryEmbedding``'s forward and differ only in their ``cos_sin_cache``)."""
