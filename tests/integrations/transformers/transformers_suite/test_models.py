"""transformers' ``ModelTesterMixin`` (and our ``GenerationTesterMixin``) for Llama, Qwen2,
Mixtral and Gemma2: a ``...Plain`` and a ``...Opmux`` class per architecture (see conftest)."""

from __future__ import annotations

import unittest
from typing import Any

from _suite import ARCHITECTURES, DecoderModelTester, GenerationTesterMixin, model_classes
from transformers_tests.test_modeling_common import ModelTesterMixin


def _set_up(self: Any) -> None:
    self.model_tester = DecoderModelTester(self, self.model_type)


def _test_class(name: str, **attributes: Any) -> type:
    return type(name, (ModelTesterMixin, GenerationTesterMixin, unittest.TestCase),
                {"__module__": __name__, "setUp": _set_up, **attributes})


def _add_classes(model_type: str, prefix: str) -> None:
    """``<Prefix>PlainTest`` and ``<Prefix>OpmuxTest`` (the only TestCase names here:
    pytest collects every module attribute that is one)."""
    classes = model_classes(model_type)
    plain = _test_class(f"{prefix}PlainTest", all_model_classes=classes,
                        model_type=model_type, opmux=False)
    globals()[plain.__name__] = plain
    globals()[f"{prefix}OpmuxTest"] = _test_class(
        f"{prefix}OpmuxTest", all_model_classes=classes, model_type=model_type, opmux=True,
        reference=plain)


for _model_type, (_prefix, _) in ARCHITECTURES.items():
    _add_classes(_model_type, _prefix)
