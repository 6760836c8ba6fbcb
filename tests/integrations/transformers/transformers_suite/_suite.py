"""The project's own pieces of the transformers suite: the model tester the common mixins
ask for, the two mixins ``test_modeling_common`` imports but the source distribution does not
ship (``ExportTesterMixin``: no export tests here; ``GenerationTesterMixin``: a few
generation checks of our own), and the test classes of the four architectures.

Written from transformers' documented test contract: a test class sets ``all_model_classes``
and, in ``setUp``, ``self.model_tester``, whose ``prepare_config_and_inputs_for_common()``
returns ``(config, inputs)`` and which names ``batch_size``, ``seq_length``, ``is_training``,
``num_hidden_layers``, ``num_attention_heads``, ``hidden_size``.
"""

from __future__ import annotations

import unittest
from typing import Any

import torch


class ExportTesterMixin:
    """``ModelTesterMixin``'s base in transformers' repository (export tests; not run here)."""


class GenerationTesterMixin:
    """Generation checks of the project's own, for every generative class of the test class.

    (transformers' own ``GenerationTesterMixin`` lives in its repository's
    ``tests/generation``, which the source distribution does not ship.)
    """

    model_tester: Any
    all_model_classes: tuple[type, ...]
    assertEqual: Any

    def _generative(self) -> list[Any]:
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        models = []
        for cls in self.all_model_classes:
            if cls.can_generate():
                torch.manual_seed(0)
                models.append((cls(config).eval(), inputs["input_ids"]))
        return models

    def test_greedy_generate_matches_argmax_of_forward(self) -> None:
        for model, ids in self._generative():
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                     eos_token_id=None)
                step = ids
                for _ in range(4):  # no cache, the whole sequence each time
                    logits = model(step, use_cache=False).logits[:, -1]
                    step = torch.cat((step, logits.argmax(-1, keepdim=True)), dim=-1)
            self.assertEqual(out.tolist(), step.tolist())

    def test_beam_search_and_sampling_generate(self) -> None:
        for model, ids in self._generative():
            with torch.no_grad():
                beams = model.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False,
                                       pad_token_id=0, eos_token_id=None)
                torch.manual_seed(0)
                sampled = model.generate(ids, max_new_tokens=3, do_sample=True, top_k=5,
                                         pad_token_id=0, eos_token_id=None)
            self.assertEqual(tuple(beams.shape), (ids.shape[0], ids.shape[1] + 3))
            self.assertEqual(tuple(sampled.shape), (ids.shape[0], ids.shape[1] + 3))

    def test_left_padding_keeps_the_last_logits(self) -> None:
        for model, ids in self._generative():
            pad = torch.zeros(ids.shape[0], 3, dtype=ids.dtype)
            mask = torch.cat((torch.zeros_like(pad), torch.ones_like(ids)), dim=-1)
            with torch.no_grad():
                want = model(ids).logits[:, -1]
                got = model(torch.cat((pad, ids), dim=-1), attention_mask=mask).logits[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    def test_generate_with_and_without_cache(self) -> None:
        for model, ids in self._generative():
            with torch.no_grad():
                cached = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True,
                                        pad_token_id=0, eos_token_id=None)
                uncached = model.generate(ids, max_new_tokens=4, do_sample=False,
                                          use_cache=False, pad_token_id=0, eos_token_id=None)
            self.assertEqual(cached.tolist(), uncached.tolist())


# ---------------------------------------------------------------------------- the models
_COMMON: dict[str, Any] = dict(vocab_size=99, hidden_size=32, intermediate_size=37,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               initializer_range=0.02)

ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {"hidden_act": "silu"}),
    "qwen2": ("Qwen2", {"hidden_act": "silu"}),
    # transformers' grouped_mm experts need 16-byte strides (fp16 too): an intermediate size of 8k
    "mixtral": ("Mixtral", {"hidden_act": "silu", "intermediate_size": 40, "num_local_experts": 4,
                            "num_experts_per_tok": 2, "router_jitter_noise": 0.0}),
    "gemma2": ("Gemma2", {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4,
                          "attn_logit_softcapping": 30.0, "final_logit_softcapping": 20.0,
                          "query_pre_attn_scalar": 8}),
}
"""model type -> (class-name prefix, its config arguments beyond the common ones)."""

_HEADS = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification",
          "ForQuestionAnswering")


class DecoderModelTester:
    """Tiny configs and inputs of one decoder-only architecture (batch 3, 7 tokens, the rows
    right-padded to 1..3 and 7 real tokens)."""

    batch_size = 3
    seq_length = 7
    is_training = True
    hidden_size = _COMMON["hidden_size"]
    num_hidden_layers = _COMMON["num_hidden_layers"]
    num_attention_heads = _COMMON["num_attention_heads"]
    vocab_size = _COMMON["vocab_size"]

    def __init__(self, parent: unittest.TestCase, model_type: str) -> None:
        import transformers

        self.parent = parent
        prefix, extra = ARCHITECTURES[model_type]
        self.config_class = getattr(transformers, f"{prefix}Config")
        self.extra = extra

    def get_config(self) -> Any:
        return self.config_class(**{**_COMMON, **self.extra})

    def prepare_config_and_inputs_for_common(self) -> tuple[Any, dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, self.vocab_size, (self.batch_size, self.seq_length),
                            generator=generator)
        lengths = torch.tensor([1, 3, self.seq_length])
        mask = (torch.arange(self.seq_length) < lengths[:, None]).long()
        return self.get_config(), {"input_ids": ids, "attention_mask": mask}


def model_classes(model_type: str) -> tuple[type, ...]:
    """The architecture's model classes transformers exports (base model and heads)."""
    import transformers

    prefix = ARCHITECTURES[model_type][0]
    return tuple(getattr(transformers, f"{prefix}{head}") for head in _HEADS
                 if hasattr(transformers, f"{prefix}{head}"))
