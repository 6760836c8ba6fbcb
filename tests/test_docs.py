"""The documentation's examples run: README's Python block and every module doctest."""

from __future__ import annotations

import doctest
import importlib
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from opmux import Op

ROOT = Path(__file__).resolve().parents[1]

#: modules whose docstrings carry ``>>>`` examples
DOCTEST_MODULES = [
    "opmux.core.registry",
    "opmux.layers.custom_op",
    "opmux.core.runners",
    "opmux.core.forward_context",
    "opmux.layers.moe",
    "opmux.layers.moe_methods",
    "opmux.layers.moe_router",
    "opmux.layers.rotary",
    "opmux.ops.cache",
    "opmux.testing",
    "opmux.cli.table",
]


def test_readme_python_example_runs() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    runnable = [b for b in blocks if "import torch, opmux" in b]
    assert runnable, "README lost its runnable example"
    for block in runnable:
        # a fresh interpreter: the example defines ops in the global registry
        proc = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                              cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]


def _doctests(mod: ModuleType) -> list[doctest.DocTest]:
    """The module's doctests, plus those of the catalog ops it defines.

    ``@register_op`` turns a function into an :class:`opmux.Op`, which ``doctest`` does not
    look into: the examples are in the docstring of the op's native function.
    """
    finder = doctest.DocTestFinder()
    tests = finder.find(mod)
    for name, value in vars(mod).items():
        native = getattr(value, "native", None)
        if isinstance(value, Op) and getattr(native, "__module__", None) == mod.__name__:
            tests += finder.find(native, f"{mod.__name__}.{name}", module=mod,
                                 globs=dict(vars(mod)))
    return tests


@pytest.mark.parametrize("module", DOCTEST_MODULES)
def test_doctests(module: str) -> None:
    mod = importlib.import_module(module)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in _doctests(mod):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0, f"{module} has no doctest examples"
    assert result.failed == 0
