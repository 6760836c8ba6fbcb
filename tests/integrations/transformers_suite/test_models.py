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


for _model_type, (_prefix, _) in ARCHITECTURES.items():
    _classes = model_classes(_model_type)
    _plain = _test_class(f"{_prefix}PlainTest", all_model_classes=_classes,
                         model_type=_model_type, opmux=False)
    globals()[_plain.__name__] = _plain
    globals()[f"{_prefix}OpmuxTest"] = _test_class(
        f"{_prefix}OpmuxTest", all_model_classes=_classes, model_type=_model_type, opmux=True,
        reference=_plain)
