"""transformers' own model tests, plain and with opmux on (the ``transformers`` lane).

Collected only with ``OPMUX_TRANSFORMERS_SUITE=1`` (``.ci/test-lane transformers``): the
common test mixins (``tests/test_modeling_common.py`` and the other top-level ``tests/*.py``)
come from the source distribution of the installed transformers release, downloaded with pip
at test time into ``$OPMUX_TRANSFORMERS_TESTS`` (default ``~/.cache/opmux/transformers-tests``)
and never copied into this repository; the testers and test classes are ours (``_suite.py``).

Each architecture has two test classes with the same tests: ``...Plain`` (the reference)
and ``...Opmux``, where every model the tests build is enabled
(``opmux.integrations.transformers.enable`` at the end of its ``post_init``). A test that
fails with opmux is run again in its ``...Plain`` twin: if it fails there too it is an
expected failure (transformers' own result on this machine); if it passes there, the opmux
failure stands -- except for the tests of :data:`EXCLUDED` (strict expected failures, each
with its reason). By default only the opmux classes run (the reference where needed);
``OPMUX_TRANSFORMERS_SUITE_REFERENCE=all`` runs the plain classes too, to measure the plain
pass count. The summary line prints the counts and how many tests ran an opmux op
(``OPMUX_TRACE`` counts).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("OPMUX_TRANSFORMERS_SUITE") != "1":
    collect_ignore_glob = ["test_*.py"]

PACKAGE = "transformers_tests"
"""The import name of the downloaded ``tests/`` directory."""

_MOCKED_EXPERTS = ("asserts that the experts function the config names (a Mock of "
                   "transformers' batched_mm / grouped_mm) is called; an enabled model's "
                   "experts run fused_moe")

EXCLUDED: dict[tuple[str, str], str] = {
    ("mixtral", f"test_eager_matches_batched_and_grouped_inference_{case}"): _MOCKED_EXPERTS
    for case in ("0_fp16", "1_fp32", "2_bf16")
}
"""(model type, test name) -> why it cannot pass with opmux on (it asserts a transformers
internal)."""

#: test class -> outcome per test name in the reference run (plain)
_STATS = {"plain_passed": 0, "opmux_passed": 0, "opmux_enabled": 0, "opmux_ran_op": 0}


def _cache() -> Path:
    import transformers

    root = Path(os.environ.get("OPMUX_TRANSFORMERS_TESTS",
                               Path.home() / ".cache" / "opmux" / "transformers-tests"))
    return root / transformers.__version__


def _download(cache: Path) -> None:
    """Unpack the release's top-level ``tests/*.py`` into ``cache/transformers_tests``."""
    import transformers

    version = transformers.__version__
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"transformers=={version}", "-d", tmp],
                       check=True)
        (sdist,) = Path(tmp).glob("transformers-*.tar.gz")
        target = Path(tmp) / PACKAGE
        target.mkdir()
        prefix = f"transformers-{version}/tests/"
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                name = member.name.removeprefix(prefix)
                if member.isfile() and member.name.startswith(prefix) and "/" not in name \
                        and name.endswith(".py"):
                    source = archive.extractfile(member)
                    assert source is not None
                    (target / name).write_bytes(source.read())
        (target / "__init__.py").write_text("")
        target.rename(cache / PACKAGE)  # whole or not at all


def _install_sources() -> None:
    """Make ``transformers_tests`` importable, with the two modules it imports from the
    repository's test tree (not in the source distribution) served by ``_suite``."""
    import _suite

    cache = _cache()
    if not (cache / PACKAGE / "test_modeling_common.py").exists():
        _download(cache)
    sys.path.insert(0, str(cache))
    for name, attr in (("exporters.test_export", "ExportTesterMixin"),
                       ("generation.test_utils", "GenerationTesterMixin")):
        package = name.partition(".")[0]
        for full in (f"{PACKAGE}.{package}", f"{PACKAGE}.{name}"):
            sys.modules.setdefault(full, types.ModuleType(full))
        setattr(sys.modules[f"{PACKAGE}.{name}"], attr, getattr(_suite, attr))


#: the markers transformers' test modules use (this project's pytest runs --strict-markers)
_MARKERS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
            "torch_compile_test",
            "is_agent_test", "is_expert_parallel_test", "is_fsdp_test", "is_pipeline_test",
            "is_staging_test", "is_tensor_parallel_test", "is_training_test", "order")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("OPMUX_TRANSFORMERS_SUITE") == "1":
        for marker in _MARKERS:
            config.addinivalue_line("markers", f"{marker}: a marker of transformers' tests")
        _install_sources()


def _full() -> bool:
    """``OPMUX_TRANSFORMERS_SUITE_REFERENCE=all`` also runs every ``...Plain`` class (to
    measure the plain pass count); by default the reference run of a test happens only
    where its opmux run failed."""
    return os.environ.get("OPMUX_TRANSFORMERS_SUITE_REFERENCE") == "all"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        if not hasattr(cls, "opmux"):
            kept.append(item)
            continue
        if not cls.opmux and not _full():  # type: ignore[union-attr]
            dropped.append(item)
            continue
        kept.append(item)
        _SUITE_IDS[item.nodeid] = (cls.model_type, cls.opmux)  # type: ignore[union-attr]
        # transformers' tests warn freely (deprecations, hub notices): not errors here
        item.add_marker(pytest.mark.filterwarnings("default"))
        reason = EXCLUDED.get((cls.model_type, item.name))  # type: ignore[union-attr]
        if cls.opmux and reason is not None:  # type: ignore[union-attr]
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


#: whether the ``post_init`` patch enables models (off while a reference runs inside it)
_ENABLING = [True]
#: (model type, test name) -> the reference run's outcome
_REFERENCE: dict[tuple[str, str], str] = {}
#: node id of a suite test -> (model type, whether opmux is on)
_SUITE_IDS: dict[str, tuple[str, bool]] = {}


@pytest.fixture(autouse=True)
def _enable_every_model(request: pytest.FixtureRequest,
                        monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In an ``...Opmux`` class, enable every supported model at the end of its
    ``post_init`` (constructors and ``from_pretrained`` alike); count the test."""
    if not getattr(request.cls, "opmux", False):
        yield
        return
    from transformers import PreTrainedModel

    from opmux.core import trace
    from opmux.integrations import transformers as otf

    original = PreTrainedModel.post_init
    enabled: list[int] = []

    def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if _ENABLING[0] and getattr(self.config, "model_type", None) in otf.SUPPORTED_MODEL_TYPES:
            otf.enable(self)
            enabled.append(1)
        return result

    monkeypatch.setattr(PreTrainedModel, "post_init", post_init)
    before = trace.counts()
    yield
    if enabled:
        _STATS["opmux_enabled"] += 1
        if trace.counts() != before:
            _STATS["opmux_ran_op"] += 1


def _reference(item: pytest.Item) -> str:
    """The outcome of ``item``'s test in its ``...Plain`` twin (``cls.reference``): the one
    recorded in this session, else a run of it now (unittest's runner, no opmux)."""
    cls: Any = item.cls  # type: ignore[attr-defined]
    key = (cls.model_type, item.name)
    if key not in _REFERENCE:
        import unittest

        result = unittest.TestResult()
        _ENABLING[0] = False
        try:
            cls.reference(item.name).run(result)
        finally:
            _ENABLING[0] = True
        _REFERENCE[key] = "failed" if result.failures or result.errors else "passed"
    return _REFERENCE[key]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failure (of the test or of one of its subtests, whose reports pass here too) that
    the reference shares becomes an expected failure."""
    outcome = yield
    report = outcome.get_result()
    cls: Any = getattr(item, "cls", None)
    if not hasattr(cls, "opmux") or not report.failed or report.when == "teardown":
        return
    key = (cls.model_type, item.name)
    if not cls.opmux:
        _REFERENCE[key] = "failed"
        report.outcome = "skipped"
        report.wasxfail = "fails in plain transformers on this machine (the reference run)"
    elif key not in EXCLUDED and _reference(item) == "failed":
        report.outcome = "skipped"
        report.wasxfail = "fails without opmux too (the reference run)"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if type(report) is not pytest.TestReport or report.when != "call":
        return  # (a subtest's report is a subclass)
    model_type, opmux = _SUITE_IDS.get(report.nodeid, (None, None))
    if model_type is None:
        return
    if not opmux:
        _REFERENCE.setdefault((model_type, report.nodeid.rpartition("::")[2]), report.outcome)
    if report.passed:
        _STATS["opmux_passed" if opmux else "plain_passed"] += 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _STATS["opmux_enabled"]:
        return
    s = _STATS
    plain = f"{s['plain_passed']} pass plain" if _full() \
        else "the reference runs only where opmux failed"
    terminalreporter.write_line(
        f"transformers suite: {s['opmux_passed']} tests pass with opmux on ({plain}; "
        f"{len(EXCLUDED)} excluded, see EXCLUDED); "
        f"{s['opmux_ran_op']} of the {s['opmux_enabled']} tests that enabled a model ran "
        f"an opmux op")
