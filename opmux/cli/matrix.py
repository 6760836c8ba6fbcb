"""``opmux matrix REPORT.json...``: merge ``opmux check --json`` reports into one table.

Each report comes from one machine or CI lane; its header (see
:func:`opmux.cli.check.report_header`) says where it ran. The matrix has one row per op and
one column per report label x provider; each cell is

- ``pass`` (with the worst error as a share of the tolerance),
- ``fail`` (how many cases failed, the largest error against its tolerance),
- ``declined`` (the provider is registered but did not run: unsupported there, or it
  declined every case), or
- ``absent`` (that report has no such op x provider).

Each report is checked against the versioned schema of :mod:`opmux.cli.report_schema`
(an unknown verdict, a verdict its cases contradict or an op x provider given twice is an
error naming the file and the field). Columns belong to their report: labels that coincide
get the device name, then the report's position, so no two columns share a title.

It is printed as Markdown (for a CI summary or a README table) or, with ``--json``, as strict
JSON (non-finite numbers as the strings ``"inf"``, ``"-inf"``, ``"nan"``). A report path
that does not exist is listed as absent with ``--allow-missing`` (CI: a lane that did not
run), and is an error otherwise; a file that is not a report is always an error.

Exit status: 0 when merged (a failing cell is not an error here: the lanes' tests fail for
it), 2 for a missing or bad report file.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from opmux.cli.strict_json import dumps
from opmux.core.errors import OpmuxError

__all__ = ["HELP", "Cell", "Matrix", "ReportError", "Report", "add_arguments", "format_markdown",
           "load_report", "merge", "run"]

HELP: Final = "merge `opmux check --json` reports of several machines/lanes into one table"

STATUSES: Final = ("pass", "fail", "declined", "absent")
"""The values of :attr:`Cell.status`."""


class ReportError(OpmuxError, ValueError):
    """A file given to ``opmux matrix`` is missing or is not an ``opmux check --json`` report.

    :ivar path: the file.
    """

    def __init__(self, path: str | Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)


ReportError.__module__ = "opmux.cli.matrix"


@dataclass(frozen=True)
class Cell:
    """One op x provider in one report."""

    status: str
    detail: str = ""
    #: worst ``|got - want| / tolerance`` over the cases that ran (at most 1 passes)
    ratio: float | None = None
    #: largest absolute error over the cases that ran
    max_abs: float | None = None


ABSENT: Final = Cell("absent")


@dataclass
class Report:
    """One ``opmux check --json`` report: its header and its cells by ``(op, provider)``."""

    path: str
    label: str
    platform: str
    device: str
    device_name: str
    versions: dict[str, str | None]
    created: str
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)

    @property
    def providers(self) -> list[str]:
        return sorted({p for _, p in self.cells})


@dataclass
class Matrix:
    """Reports merged: columns ``(label, provider)``, one row of cells per op."""

    reports: list[Report]
    absent: list[str]
    columns: list[tuple[str, str]]
    rows: dict[str, list[Cell]]

    def as_dict(self) -> dict[str, Any]:
        """Plain data (the ``--json`` output)."""
        return {
            "reports": [{"path": r.path, "label": r.label, "platform": r.platform,
                         "device": r.device, "device_name": r.device_name,
                         "created": r.created, "versions": r.versions} for r in self.reports],
            "absent_reports": self.absent,
            "columns": [f"{label}/{provider}" for label, provider in self.columns],
            "rows": [{"op": op, "cells": {f"{label}/{provider}": cell.__dict__
                                          for (label, provider), cell
                                          in zip(self.columns, cells, strict=True)}}
                     for op, cells in self.rows.items()],
        }


def _cell(entry: dict[str, Any]) -> Cell:
    """The cell of one ``reports[]`` entry (checked by :func:`parse_report`)."""
    verdict, cases = entry["verdict"], entry["cases"]
    ran = [c for c in cases if c["status"] in ("pass", "fail", "error")]
    ratio = max((c["ratio"] for c in ran), default=None)
    max_abs = max((c["max_abs"] for c in ran), default=None)
    if verdict == "PASS":
        return Cell("pass", f"err/tol {ratio:.2g}" if ratio else "", ratio, max_abs)
    if verdict == "FAIL":
        bad = [c for c in cases if c["status"] in ("fail", "error")]
        worst = max(bad, key=lambda c: c["ratio"])
        raised = sum(c["status"] == "error" for c in bad)
        detail = f"{len(bad)}/{len(cases)} cases"
        if worst["ratio"] > 0 or math.isnan(worst["ratio"]):
            detail += (f"; max err {worst['max_abs']:.2g} vs atol {worst['atol']:g}"
                       f" rtol {worst['rtol']:g} (x{worst['ratio']:.2g})")
        if raised:
            detail += f"; {raised} raised"
        return Cell("fail", detail, ratio, max_abs)
    # UNSUPPORTED (supported=False there) or SKIP (no case ran: declined, or no cases)
    lines = [line for line in entry["reason"].splitlines() if line.strip()]
    reason = lines[0] if lines else ("every case declined" if cases else "no cases")
    return Cell("declined", reason[:80], ratio, max_abs)


MAX_REPORT_BYTES: Final = 64 << 20
"""The largest report file read (64 MiB)."""


def load_report(path: str | Path) -> Report:
    """Read one ``opmux check --json`` report and check it against
    :mod:`opmux.cli.report_schema`.

    :raises ReportError: the file is missing, unreadable, not UTF-8 JSON, or breaks the
        schema; the message names the file and the field and says how to make a report.
    """
    from opmux.cli.report_schema import SchemaError, parse_report
    from opmux.core._cache_json import read_cache_json

    p = Path(path)
    data, why = read_cache_json(p, MAX_REPORT_BYTES)
    if why == "missing":
        raise ReportError(p, "no such file (pass --allow-missing to list it as absent)")
    if why is not None:
        raise ReportError(p, f"{why}; write reports with `opmux check --json > FILE`")
    try:
        parsed = parse_report(data)
    except SchemaError as exc:
        raise ReportError(p, f"not an `opmux check --json` report: {exc}") from None
    report = Report(str(p), parsed["label"], parsed["platform"], parsed["device"],
                    parsed["device_name"], parsed["versions"], parsed["created"])
    for entry in parsed["reports"]:
        report.cells[(entry["op"], entry["provider"])] = _cell(entry)
    return report


def _unique_labels(reports: list[Report]) -> None:
    """Make labels distinct: add the device name where two coincide, then the report's
    position where they still do, then (for a label written like such a fixed one) the
    position again until no two are equal."""
    fixes = (lambda r, i: f"{r.label} ({r.device_name})", lambda r, i: f"{r.label} #{i}")
    for fix in fixes:
        counts = Counter(r.label for r in reports)
        for i, r in enumerate(reports, 1):
            if counts[r.label] > 1:
                r.label = fix(r, i)
    taken: set[str] = set()
    for i, r in enumerate(reports, 1):
        while r.label in taken:
            r.label = f"{r.label} #{i}"
        taken.add(r.label)


def merge(reports: list[Report], absent: list[str] | None = None) -> Matrix:
    """Merge ``reports`` (in order) into a :class:`Matrix`; ``absent`` lists report files
    that do not exist (shown, no columns)."""
    _unique_labels(reports)
    owned = [(r, p) for r in reports for p in r.providers]  # each column knows its report
    columns = [(r.label, p) for r, p in owned]
    ops = sorted({op for r in reports for op, _ in r.cells})
    rows = {op: [r.cells.get((op, provider), ABSENT) for r, provider in owned] for op in ops}
    return Matrix(reports, list(absent or []), columns, rows)


def _escape(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def format_markdown(matrix: Matrix) -> str:
    """The matrix as a Markdown table, preceded by one line per report (where it ran) and
    followed by the totals per column."""
    lines = ["| report | platform | device | versions |", "|---|---|---|---|"]
    for r in matrix.reports:
        versions = ", ".join(f"{k} {v}" for k, v in r.versions.items() if v)
        lines.append(f"| {_escape(r.label)} | {r.platform} | {_escape(r.device)}: "
                     f"{_escape(r.device_name)} | {_escape(versions)} |")
    for path in matrix.absent:
        lines.append(f"| {_escape(Path(path).stem)} | absent | - | report {_escape(path)} "
                     f"not written (lane not run or failed early) |")
    lines.append("")
    if not matrix.columns:
        lines.append("(no op x provider in any report)")
        return "\n".join(lines)
    lines.append("| op | " + " | ".join(f"{_escape(label)}/{provider}"
                                        for label, provider in matrix.columns) + " |")
    lines.append("|---" * (len(matrix.columns) + 1) + "|")
    for op, cells in matrix.rows.items():
        text = [c.status + (f" ({_escape(c.detail)})" if c.detail and c.status != "absent"
                            else "") for c in cells]
        lines.append(f"| {_escape(op)} | " + " | ".join(text) + " |")
    totals = []
    for i in range(len(matrix.columns)):
        counts = {s: 0 for s in STATUSES}
        for cells in matrix.rows.values():
            counts[cells[i].status] += 1
        totals.append(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    lines.append("| **total** | " + " | ".join(totals) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``matrix`` options to ``parser``."""
    parser.add_argument("reports", nargs="+", metavar="REPORT.json",
                        help="`opmux check --json` outputs (one per machine or lane)")
    parser.add_argument("--json", action="store_true", help="print the matrix as JSON")
    parser.add_argument("--allow-missing", action="store_true",
                        help="list a report file that does not exist as absent instead of "
                             "failing (CI: a lane that did not run)")


def run(ns: argparse.Namespace) -> int:
    """Run ``opmux matrix`` with parsed options; returns the exit status."""
    reports, absent = [], []
    for path in ns.reports:
        if ns.allow_missing and not Path(path).exists():
            absent.append(path)
            continue
        reports.append(load_report(path))
    matrix = merge(reports, absent)
    if ns.json:
        print(dumps(matrix.as_dict()))
    else:
        print(format_markdown(matrix))
    return 0
