"""``opmux check``: run the conformance kit over ops x providers and print a table.

With ``--json`` it prints a report: a header saying where it ran (:func:`report_header`:
label, platform, device name, the versions of opmux and of each stack) and one entry per
op x provider, in the schema of :mod:`opmux.cli.report_schema` (strict JSON: a non-finite
error is written ``"inf"`` or ``"nan"``). ``opmux matrix`` merges such reports from several
machines or lanes. ``--device`` must name a device that exists here (not ``meta``: a check
compares values); it is checked before any op runs.

Exit status: 0 when every checked provider passes, 1 when any case fails, 2 for a usage
error (unknown op or provider).
"""

from __future__ import annotations

import argparse
import datetime
import platform as _host
import sys
from typing import Any, Final

from opmux.cli import report_schema
from opmux.cli._option_checks import run_device
from opmux.cli.strict_json import dumps
from opmux.cli.table import format_table

__all__ = ["HELP", "REPORT_FORMAT", "add_arguments", "report_header", "run", "select_ops"]

HELP: Final = "conformance of providers against native"

REPORT_FORMAT: Final = report_schema.REPORT_FORMAT
"""The ``format`` field of a ``--json`` report; ``opmux matrix`` reads this format
(:mod:`opmux.cli.report_schema`)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``check`` options to ``parser``."""
    parser.add_argument("--op", action="append", default=[], metavar="OP",
                        help="check only this op (repeatable; 'ns::name' for other namespaces)")
    parser.add_argument("--provider", action="append", default=[], metavar="NAME",
                        help="check only this provider (repeatable; default: every provider "
                             "registered here except native)")
    parser.add_argument("--device", default="cpu",
                        help="device the providers run on (default: cpu; native runs on cpu)")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON report (header: platform, device, versions)")
    parser.add_argument("--label", default=None,
                        help="name of this run in the report, e.g. a CI lane (default: the "
                             "platform name); `opmux matrix` titles its columns with it")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print every case of every provider")


def select_ops(names: list[str], command: str) -> list[Any] | None:
    """The ops named on the command line (all when none), plugins loaded; ``None`` after
    printing the error when a name is unknown."""
    import opmux

    opmux.load_plugins()
    ops = opmux.list_ops()
    if not names:
        return ops
    by_name = {o.qualname: o for o in ops} | {o.name: o for o in ops if o.namespace == "opmux"}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        print(f"opmux {command}: unknown op(s) {unknown}; known: "
              f"{sorted(o.qualname for o in ops)}", file=sys.stderr)
        return None
    return [by_name[name] for name in dict.fromkeys(names)]


def _device_name(device: str) -> str:
    """A human name of ``device``: the GPU's name, the CPU's model, else the device string."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:  # a device type torch does not know yet (its backend not imported)
        return device
    if kind == "cuda" and torch.cuda.is_available():
        return str(torch.cuda.get_device_name(torch.device(device)))
    if kind == "cpu":
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return _host.processor() or _host.machine() or "cpu"
    return device


def report_header(device: str, label: str | None = None) -> dict[str, Any]:
    """Where a report was made: the ``--json`` header ``opmux matrix`` reads.

    :param device: the device the providers ran on (``--device``).
    :param label: the run's name (``--label``); default the platform's name.
    """
    import opmux
    from opmux.cli.info import stack_versions

    platform = opmux.current_platform()
    return {
        "format": REPORT_FORMAT,
        "label": label or platform.name,
        "platform": platform.name,
        "device": device,
        "device_name": _device_name(device),
        "host": _host.node(),
        "python": _host.python_version(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"opmux": opmux.__version__, **stack_versions()},
    }


def run(ns: argparse.Namespace) -> int:
    """Run ``opmux check`` with parsed options; returns the exit status."""
    import opmux
    from opmux.core.errors import ConfigError
    from opmux.testing.conformance import ProviderReport, check_provider

    run_device(ns.device, "check")
    if ns.label is not None and not ns.label.strip():
        raise ConfigError("opmux check: --label must not be empty (it titles the report's "
                          "columns in `opmux matrix`)")
    ops = select_ops(ns.op, "check")
    if ops is None:
        return 2
    known = sorted({p for o in opmux.list_ops() for p in o.impls} - {"native"})
    bad = [p for p in ns.provider if p not in known]
    if bad:
        print(f"opmux check: unknown provider(s) {bad}; registered here: {known}",
              file=sys.stderr)
        return 2
    reports: list[ProviderReport] = []
    for op in ops:
        for provider in op.impls:
            if provider == "native" or (ns.provider and provider not in ns.provider):
                continue
            reports.append(check_provider(op, provider, ns.device))
    failed = any(not r.ok for r in reports)
    if ns.json:
        payload: dict[str, Any] = {**report_header(ns.device, ns.label), "ok": not failed,
                                   "reports": [r.as_dict() for r in reports]}
        print(dumps(payload))
        return 1 if failed else 0
    if not reports:
        print("opmux check: no provider to check (only native is registered for the "
              "selected ops); see `opmux info`")
        return 0
    rows = []
    for r in reports:
        c = r.counts
        worst = max((x.ratio for x in r.cases if x.status == "pass"), default=0.0)
        rows.append([r.op, r.provider, r.verdict(), str(c["pass"]), str(c["fail"] + c["error"]),
                     str(c["skip"]), f"{worst:.3g}", r.reason])
    print(format_table(rows, ["op", "provider", "result", "pass", "fail", "skip", "err/tol",
                              "note"]))
    for r in reports:
        if ns.verbose or not r.ok:
            print()
            print(r.format())
            for case in r.cases:
                if not case.ok:
                    print(f"\n  {case.name}: {case.describe()}")
    total = len(reports)
    bad_n = sum(not r.ok for r in reports)
    print(f"\n{total - bad_n}/{total} provider checks passed on {ns.device}"
          + (f"; {bad_n} failed" if bad_n else ""))
    return 1 if failed else 0
