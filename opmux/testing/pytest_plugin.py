"""pytest plugin: parametrized conformance tests (op x case) for chosen providers.

Installed with opmux as the ``pytest11`` entry point ``opmux_conformance``, so pytest loads
it in every run; it does **nothing** until a provider is named. Enable it with one line,
either on the command line::

    pytest --opmux-provider vendor_x

or in the project's ini file (``pytest.ini``, ``[tool.pytest.ini_options]``, ...)::

    opmux_providers = vendor_x

Then every op of the global registry (the catalog plus ops plugins add, for which cases
are registered with :func:`opmux.testing.register_cases`) that has the provider gets one
test per conformance case, comparing the provider with the native reference. Options:
``--opmux-device`` / ``opmux_device`` (default ``cpu``), ``--opmux-op`` / ``opmux_ops``
(restrict to some ops). The provider name ``all`` selects every supported non-native
provider. Cases that the provider's ``supports_args`` rejects are reported as skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from opmux.testing.cases import Case

_NODE_ID = "opmux-conformance"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("opmux", "opmux provider conformance")
    group.addoption("--opmux-provider", action="append", default=[], metavar="NAME",
                    help="run the opmux conformance cases for provider NAME (repeatable; "
                         "'all' = every supported provider)")
    group.addoption("--opmux-device", default=None, metavar="DEVICE",
                    help="device the provider runs on (default: cpu)")
    group.addoption("--opmux-op", action="append", default=[], metavar="OP",
                    help="restrict the conformance cases to op OP (repeatable)")
    parser.addini("opmux_providers", "providers to run the opmux conformance cases for",
                  type="args", default=[])
    parser.addini("opmux_device", "device for the opmux conformance cases", default="cpu")
    parser.addini("opmux_ops", "ops to restrict the opmux conformance cases to",
                  type="args", default=[])


def _providers(config: pytest.Config) -> list[str]:
    names = list(config.getoption("opmux_provider", default=[]) or [])
    if not names:
        names = list(config.getini("opmux_providers") or [])
    return [n for part in names for n in str(part).split(",") if n]


def pytest_configure(config: pytest.Config) -> None:
    if _providers(config):
        config.addinivalue_line("markers", "opmux_conformance: an opmux provider conformance "
                                           "case (added by opmux.testing.pytest_plugin)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    providers = _providers(config)
    if not providers:
        return
    device = config.getoption("opmux_device", default=None) or config.getini("opmux_device")
    ops = list(config.getoption("opmux_op", default=[]) or []) or list(
        config.getini("opmux_ops") or [])
    collector = ConformanceCollector.from_parent(session, name=_NODE_ID, nodeid=_NODE_ID)
    collector.setup_selection(providers, str(device or "cpu"), ops)
    items.extend(collector.collect())


class ConformanceCollector(pytest.Collector):
    """The collector holding the conformance items (one per op x provider x case)."""

    def setup_selection(self, providers: list[str], device: str, ops: list[str]) -> None:
        self._providers = providers
        self._device = device
        self._ops = ops

    def collect(self) -> list[pytest.Item]:  # type: ignore[override]
        import opmux
        from opmux.testing.cases import cases_for, has_cases

        opmux.load_plugins()
        wanted = {o if "::" in o else f"opmux::{o}" for o in self._ops}
        items: list[pytest.Item] = []
        every = "all" in self._providers
        known: set[str] = set()
        for op in opmux.list_ops():
            known.update(op.impls)
            if wanted and op.qualname not in wanted:
                continue
            if not has_cases(op.qualname):
                continue
            names = (op.supported_providers() if every else self._providers)
            for provider in names:
                if provider == "native" or provider not in op.impls:
                    continue
                label = op.name if op.namespace == "opmux" else op.qualname.replace("::", ".")
                for case in cases_for(op.qualname):
                    items.append(ConformanceItem.from_parent(
                        self, name=f"{label}[{provider}-{case.name}]", op_name=op.qualname,
                        provider=provider, case=case, device=self._device))
        missing = [p for p in self._providers if p != "all" and p not in known]
        if missing:
            raise pytest.UsageError(
                f"opmux conformance: unknown provider(s) {missing}; providers registered "
                f"here: {sorted(known - {'native'})} (is the plugin installed and loaded? "
                f"see `opmux info`)")
        return items


class ConformanceFailure(Exception):
    """A provider's result differs from the native reference beyond tolerance."""


class ConformanceItem(pytest.Item):
    """One conformance case of one provider of one op."""

    def __init__(self, *, op_name: str, provider: str, case: Case, device: str,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.op_name = op_name
        self.provider = provider
        self.case = case
        self.device = device
        self.add_marker("opmux_conformance")

    def runtest(self) -> None:
        import opmux
        from opmux.testing.conformance import run_case

        result = run_case(opmux.get_op(self.op_name), self.provider, self.case,
                          device=self.device)
        if result.status == "skip":
            pytest.skip(result.message)
        if result.status != "pass":
            raise ConformanceFailure(result.describe())

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str:
        if isinstance(excinfo.value, ConformanceFailure):
            return (f"{self.op_name} provider {self.provider!r} on {self.device}, case "
                    f"{self.case.name!r}:\n{excinfo.value}")
        return str(super().repr_failure(excinfo, style=style))

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"{self.op_name}:{self.provider}:{self.case.name}"
