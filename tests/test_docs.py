"""The documentation's examples run: README's Python block and every module doctest."""

from __future__ import annotations

import doctest
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: modules whose docstrings carry ``>>>`` examples
DOCTEST_MODULES = [
    "opmux.core.registry",
    "opmux.core.custom_op",
    "opmux.core.runners",
    "opmux.core.forward_context",
    "opmux.layers.moe",
    "opmux.layers.rotary",
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


@pytest.mark.parametrize("module", DOCTEST_MODULES)
def test_doctests(module: str) -> None:
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module} has no doctest examples"
    assert result.failed == 0
