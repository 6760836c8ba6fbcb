"""Causal LMs from Hugging Face checkpoints, built from opmux layers, and a small engine.

>>> from opmux.models import ARCHITECTURES
>>> ARCHITECTURES
('Gemma2ForCausalLM', 'LlamaForCausalLM', 'MixtralForCausalLM', 'Qwen2ForCausalLM')

``load_model(directory, dtype)`` reads ``config.json`` and ``*.safetensors`` (never a
pickle) and returns a :class:`CausalLM`; :class:`Engine` generates from it on a paged KV
cache (see :mod:`opmux.models.engine`). ``opmux generate`` is the command line.
"""

from opmux.core.tally import ProviderTally
from opmux.models.checkpoint import CheckpointError, load_model
from opmux.models.config import ARCHITECTURES, ModelConfig, read_config
from opmux.models.decoder import AttentionBatch, CausalLM
from opmux.models.engine import BlockAllocator, Engine, GenerationOutput, SamplingParams
from opmux.models.memory import MemoryBudgetError

__all__ = [
    "ARCHITECTURES",
    "AttentionBatch",
    "BlockAllocator",
    "CausalLM",
    "CheckpointError",
    "Engine",
    "GenerationOutput",
    "MemoryBudgetError",
    "ModelConfig",
    "ProviderTally",
    "SamplingParams",
    "load_model",
    "read_config",
]
