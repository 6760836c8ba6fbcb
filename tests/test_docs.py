"""The documentation is tested: every Python block of README.md and docs/*.md runs, every
module doctest passes, and the docs stay a guide whose links, ops and settings are current.

A block that needs hardware or a heavier lane names the lane's pytest marker on the line
before its fence, ``<!-- docs-test: vllm -->``: it then carries that marker, so it runs in
that lane and is reported as skipped (with the reason) elsewhere (docs/testing.md).
"""

from __future__ import annotations

import doctest
import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

import opmux
from opmux import Op
from opmux.core import config

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: the markers a docs block may name (pyproject's lane and hardware markers)
LANE_MARKERS = frozenset({"triton", "xla", "mindspore", "vllm", "cuda", "npu", "slow"})
_DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(\S+)\s*-->")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class DocBlock:
    """One fenced code block of a docs file."""

    path: str  #: relative to the repository root
    line: int  #: 1-based line of the opening fence
    lang: str
    code: str
    directive: str | None  #: the marker named on the line before the fence, if any


def _blocks(path: Path) -> list[DocBlock]:
    lines = path.read_text().splitlines()
    rel = path.relative_to(ROOT).as_posix()
    found: list[DocBlock] = []
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```"):
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{rel}:{i + 1}: code block is never closed")
        match = _DIRECTIVE.fullmatch(lines[i - 1].strip()) if i else None
        found.append(DocBlock(rel, i + 1, fence[3:].strip(), "\n".join(lines[i + 1:end]),
                              match.group(1) if match else None))
        i = end + 1
    return found


def _python_params() -> list[object]:
    params: list[object] = []
    for path in DOC_FILES:
        for block in _blocks(path):
            if block.lang != "python":
                continue
            marks = ([getattr(pytest.mark, block.directive)]
                     if block.directive in LANE_MARKERS else [])
            params.append(pytest.param(block, marks=marks, id=f"{block.path}:{block.line}"))
    return params


@pytest.mark.parametrize("block", _python_params())
def test_docs_python_block_runs(block: DocBlock, tmp_path: Path) -> None:
    assert block.directive is None or block.directive in LANE_MARKERS, (
        f"{block.path}:{block.line}: unknown docs-test marker {block.directive!r}; "
        f"use one of {sorted(LANE_MARKERS)}")
    # a fresh interpreter per block (the examples define ops in the global registry), in an
    # empty folder (they may write files), importing this checkout's opmux
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-c", block.code], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, f"{block.path}:{block.line} failed:\n{proc.stderr[-3000:]}"


def test_docs_directives_name_a_lane_and_a_python_block() -> None:
    for path in DOC_FILES:
        lines = path.read_text().splitlines()
        in_block = False
        for n, line in enumerate(lines):
            if line.strip().startswith("```"):
                in_block = not in_block
                continue
            match = _DIRECTIVE.fullmatch(line.strip())
            if in_block or not match:
                continue
            where = f"{path.relative_to(ROOT)}:{n + 1}"
            assert match.group(1) in LANE_MARKERS, (
                f"{where}: unknown docs-test marker {match.group(1)!r}; "
                f"use one of {sorted(LANE_MARKERS)}")
            nxt = lines[n + 1].strip() if n + 1 < len(lines) else ""
            assert nxt == "```python", f"{where}: a docs-test marker must precede a python block"


def test_readme_is_a_guide() -> None:
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move reference to docs/"
    head = "\n".join(lines[:40])
    assert "make demo" in head and "make test" in head, "the two commands left the first 40 lines"
    twenty = [b for b in _blocks(ROOT / "README.md")
              if b.lang == "python" and "import torch, opmux" in b.code]
    assert twenty and twenty[0].directive is None, "README lost its runnable example"
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in text, f"README's map of the docs misses docs/{page.name}"
    assert "](benchmarks/RESULTS.md)" in text


def test_docs_relative_links_resolve() -> None:
    for path in [*DOC_FILES, ROOT / "benchmarks" / "RESULTS.md"]:
        for target in _LINK.findall(path.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            file = target.split("#", 1)[0]
            assert (path.parent / file).exists(), (
                f"{path.relative_to(ROOT)} links to {target!r}, which does not exist")


def test_ops_page_names_every_catalog_op() -> None:
    text = (ROOT / "docs" / "ops.md").read_text()
    catalog = [op for op in opmux.list_ops() if op.native.__module__.startswith("opmux.ops.")]
    missing = sorted(op.name for op in catalog if f"`{op.name}" not in text)
    assert not missing, f"docs/ops.md does not describe {missing}"


def test_configuration_page_lists_every_variable() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    names = {getattr(config, n) for n in dir(config) if n.startswith("ENV_")}
    names |= set(re.findall(r"^``([A-Z][A-Z0-9_]+)``", config.__doc__ or "", flags=re.M))
    assert names >= {"OPMUX_PRIORITY", "OPMUX_CACHE_DIR", "CXX"}, names
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"docs/configuration.md does not list {missing}"


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
    "opmux.ops.linear",
    "opmux.testing",
    "opmux.cli.table",
]


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
