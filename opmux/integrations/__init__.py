"""Bridges that put opmux ops under other engines' layers (:mod:`opmux.integrations.vllm`)."""
