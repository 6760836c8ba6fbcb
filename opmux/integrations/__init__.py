"""Bridges that put opmux ops under other engines' layers: :mod:`opmux.integrations.vllm`
(a vLLM plugin) and :mod:`opmux.integrations.transformers` (``enable(model)``)."""
