"""The schema of an ``opmux check --json`` report, which ``opmux matrix`` reads.

Version ``opmux-check/2`` (the ``format`` field); ``opmux-check/1`` reports, the same fields
with non-finite numbers written as bare ``NaN``/``Infinity``, are read too. A report is a JSON
object:

==================  ===========================================================================
``format``          ``"opmux-check/2"``
``label``           non-empty string: the run's name (``--label``); titles its columns
``platform``        string: the platform the report was made on
``device``          string: the ``--device`` the providers ran on
``device_name``     string: the GPU's or CPU's name
``versions``        object: stack name -> version string or ``null``
``created``         string (optional): UTC time, ISO 8601
``host``            string (optional)
``python``          string (optional)
``ok``              boolean (optional): no case failed
``reports``         array of entries, at most one per op x provider
==================  ===========================================================================

An entry: ``op`` (non-empty string), ``provider`` (a provider name, ``^[a-z_][a-z0-9_]*$``),
``verdict`` (``PASS``: some case passed and none failed; ``FAIL``: some case failed or
raised; ``SKIP``: no case ran; ``UNSUPPORTED``: the provider is not supported there, no case
ran), ``cases`` (array, optional), and optional ``device``, ``status``, ``reason`` (strings)
and ``ok`` (boolean). A case: ``name`` (string), ``status`` (``pass``, ``fail``, ``error`` or
``skip``), the numbers ``max_abs``, ``max_rel``, ``ratio``, ``atol``, ``rtol``, ``seconds``
(optional, default 0) and ``message`` (string, optional).

**Numbers** are JSON numbers or, for the non-finite ones, the strings ``"inf"``, ``"-inf"``
and ``"nan"`` (:mod:`opmux.cli.strict_json`): a report is strict JSON.

:func:`parse_report` checks a parsed document against this schema and returns it with its
numbers as floats and the optional fields filled; the first field it rejects is named in a
:class:`SchemaError`.
"""

from __future__ import annotations

import re
from typing import Any, Final

from opmux.cli.strict_json import read_number
from opmux.core.errors import OpmuxError

__all__ = ["CASE_STATUSES", "READABLE_FORMATS", "REPORT_FORMAT", "SchemaError", "VERDICTS",
           "parse_report"]

REPORT_FORMAT: Final = "opmux-check/2"
"""The ``format`` field ``opmux check --json`` writes."""

READABLE_FORMATS: Final = ("opmux-check/1", REPORT_FORMAT)
"""The report formats ``opmux matrix`` reads."""

VERDICTS: Final = ("PASS", "FAIL", "SKIP", "UNSUPPORTED")
"""The values of an entry's ``verdict``."""

CASE_STATUSES: Final = ("pass", "fail", "error", "skip")
"""The values of a case's ``status``."""

_NUMBERS: Final = ("max_abs", "max_rel", "ratio", "atol", "rtol", "seconds")
_PROVIDER: Final = re.compile(r"[a-z_][a-z0-9_]*")
_HEADER_TEXT: Final = ("label", "platform", "device", "device_name")
_OPTIONAL_TEXT: Final = ("created", "host", "python")


class SchemaError(OpmuxError, ValueError):
    """A report breaks the schema.

    :ivar field: where, e.g. ``reports[3].cases[0].ratio``.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"field {field}: {message}")
        self.field = field


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _got(obj: dict[str, Any], key: str) -> str:
    return _shown(obj[key]) if key in obj else "nothing (it is missing)"


_JSON_TYPES: Final = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
                      int: "a number", float: "a number", type(None): "null"}


def _kind(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _text(obj: dict[str, Any], key: str, where: str, *, optional: bool = False,
          non_empty: bool = False) -> str:
    value = obj.get(key)
    if value is None and optional and key not in obj:
        return ""
    if not isinstance(value, str) or (non_empty and not value.strip()):
        kind = "a non-empty string" if non_empty else "a string"
        raise SchemaError(f"{where}{key}", f"expected {kind}, got {_got(obj, key)}")
    return value


def _one_of(obj: dict[str, Any], key: str, where: str, choices: tuple[str, ...]) -> str:
    value = obj.get(key)
    if value not in choices:
        raise SchemaError(f"{where}{key}", f"expected one of {', '.join(choices)}, got "
                                           f"{_got(obj, key)}")
    return str(value)


def _flag(obj: dict[str, Any], key: str, where: str) -> None:
    if key in obj and not isinstance(obj[key], bool):
        raise SchemaError(f"{where}{key}", f"expected true or false, got {_shown(obj[key])}")


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SchemaError(where, f"expected an object, got {_kind(value)}")
    return value


def _array(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise SchemaError(where, f"expected an array, got {_kind(value)}")
    return value


def _case(value: Any, where: str) -> dict[str, Any]:
    case = _object(value, where)
    out: dict[str, Any] = {"name": _text(case, "name", f"{where}."),
                           "status": _one_of(case, "status", f"{where}.", CASE_STATUSES),
                           "message": _text(case, "message", f"{where}.", optional=True)}
    for key in _NUMBERS:
        number = read_number(case.get(key, 0.0))
        if number is None:
            raise SchemaError(f"{where}.{key}", f"expected a number or one of \"inf\", "
                                                f"\"-inf\", \"nan\", got {_shown(case[key])}")
        out[key] = number
    return out


def _entry(value: Any, where: str) -> dict[str, Any]:
    entry = _object(value, where)
    out: dict[str, Any] = {"op": _text(entry, "op", f"{where}.", non_empty=True),
                           "provider": _text(entry, "provider", f"{where}.")}
    if not _PROVIDER.fullmatch(out["provider"]):
        raise SchemaError(f"{where}.provider", f"expected a provider name "
                                               f"([a-z_][a-z0-9_]*), got "
                                               f"{_shown(out['provider'])}")
    out["verdict"] = _one_of(entry, "verdict", f"{where}.", VERDICTS)
    for key in ("device", "status", "reason"):
        out[key] = _text(entry, key, f"{where}.", optional=True)
    _flag(entry, "ok", f"{where}.")
    cases = _array(entry.get("cases", []), f"{where}.cases")
    out["cases"] = [_case(c, f"{where}.cases[{i}]") for i, c in enumerate(cases)]
    statuses = {c["status"] for c in out["cases"]}
    failed = bool(statuses & {"fail", "error"})
    verdict = out["verdict"]
    if (verdict == "FAIL") != failed or (verdict == "PASS") != ("pass" in statuses
                                                               and not failed):
        raise SchemaError(f"{where}.verdict", f"{verdict} does not match its cases' statuses "
                                              f"{sorted(statuses)} (PASS: some pass and no "
                                              f"fail or error; FAIL: some fail or error; SKIP "
                                              f"and UNSUPPORTED: none ran)")
    return out


def parse_report(data: Any) -> dict[str, Any]:
    """``data`` (a parsed report) checked against the schema, numbers as floats.

    :raises SchemaError: naming the first field that breaks the schema.
    """
    report = _object(data, "(top level)")
    if report.get("format") not in READABLE_FORMATS:
        raise SchemaError("format", f"expected one of {', '.join(READABLE_FORMATS)}, got "
                                    f"{_got(report, 'format')}: write the report again "
                                    f"with this opmux's `opmux check --json`")
    out: dict[str, Any] = {"format": report["format"],
                           "label": _text(report, "label", "", non_empty=True)}
    for key in _HEADER_TEXT[1:]:
        out[key] = _text(report, key, "")
    for key in _OPTIONAL_TEXT:
        out[key] = _text(report, key, "", optional=True)
    _flag(report, "ok", "")
    versions = _object(report.get("versions"), "versions")
    for name, version in versions.items():
        if version is not None and not isinstance(version, str):
            raise SchemaError(f"versions.{name}", f"expected a string or null, got "
                                                  f"{_shown(version)}")
    out["versions"] = dict(versions)
    entries = _array(report.get("reports"), "reports")
    out["reports"] = []
    seen: dict[tuple[str, str], int] = {}
    for i, value in enumerate(entries):
        entry = _entry(value, f"reports[{i}]")
        pair = (entry["op"], entry["provider"])
        if pair in seen:
            raise SchemaError(f"reports[{i}]", f"op {pair[0]!r} x provider {pair[1]!r} again "
                                               f"(first in reports[{seen[pair]}])")
        seen[pair] = i
        out["reports"].append(entry)
    return out
