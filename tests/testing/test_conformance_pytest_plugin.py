"""The pytest plugin: inert unless enabled; one line turns a vendor's provider into tests."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

_CONFTEST = '''
import torch
import opmux

op = opmux.get_op("silu_and_mul")

def _good(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return (torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)

def _bad(x: torch.Tensor) -> torch.Tensor:
    return _good(x) * 1.01

op.register_impl("vendor_good", dispatch_key="CPU")(_good)
op.register_impl("vendor_bad", dispatch_key="CPU",
                 supports_args=lambda x: x.dtype == torch.float32)(_bad)
'''


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # only the light example plugin: the providers under test come from the conftest
    monkeypatch.setenv("OPMUX_PLUGINS", "example_vendor")
    pytester.makeconftest(_CONFTEST)
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    return pytester


def test_plugin_loads_no_plugin_and_no_catalog_when_disabled(pytester: pytest.Pytester) -> None:
    # importing the plugin module imports the opmux package (and so torch), nothing more
    pytester.makepyfile(test_modules="""
import sys

def test_untouched():
    assert "opmux.testing.pytest_plugin" in sys.modules  # loaded from the entry point
    for name in ("opmux.testing.conformance", "opmux.ops", "opmux.plugins.cpu"):
        assert name not in sys.modules, name
    import opmux
    assert opmux.plugin_report() == []
""")
    result = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "opmux-conformance" not in result.stdout.str()


def test_command_line_option_runs_the_cases(project: pytest.Pytester) -> None:
    result = project.runpytest_subprocess("-q", "-p", "no:cacheprovider",
                                          "--opmux-provider", "vendor_good", "-rA")
    result.assert_outcomes(passed=9)  # 8 silu_and_mul cases + test_plain
    result.stdout.fnmatch_lines(["*silu_and_mul?vendor_good-fp32-basic?*"])


def test_ini_line_enables_it_and_a_wrong_provider_fails(project: pytest.Pytester) -> None:
    project.makeini("[pytest]\nopmux_providers = vendor_bad\n")
    result = project.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-rfs")
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] >= 1 and outcomes["skipped"] >= 1  # bf16/fp16 rejected: skipped
    result.stdout.fnmatch_lines(["*provider 'vendor_bad'*", "*beyond tolerance*"])


def test_unknown_provider_is_a_usage_error(project: pytest.Pytester) -> None:
    result = project.runpytest_subprocess("-q", "-p", "no:cacheprovider",
                                          "--opmux-provider", "nobody")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*opmux conformance: unknown provider(s)*nobody*"])
