"""Hostile inputs for the newer surfaces: ``opmux matrix`` report files, the ``check`` /
``tune`` / ``bench`` / ``explain`` / ``demo`` options, and KV-cache format declarations.

Plain data, as the checkpoint and cache tables of the test suite are; a driver runs every case
in one process under a memory limit (``RLIMIT_AS``). Two kinds:

- ``cli``: run ``opmux <argv>``. ``{report}`` is a file holding ``report`` (a JSON value),
  ``report_raw`` (text written as bytes with ``surrogateescape``) or ``report_blank_bytes``
  spaces; ``{scratch}`` is an empty
  folder that must stay empty. The command must end with exit status ``code`` (default 2),
  exactly one stderr line containing ``expect``, no traceback, and valid JSON on stdout when
  it succeeds with ``--json``. A case with ``cuda_ok`` names a device that exists on a
  machine with CUDA: there it is not run.
- ``declare``: ``opmux.declare_kv_cache_formats(provider, formats)`` with ``formats`` given
  (``"@callable"`` stands for a function); it must raise :class:`opmux.RegistrationError`
  containing ``expect`` and leave ``provider``'s formats as they were.

:data:`HOSTILE_SURFACE_CASES` is the table; :func:`report_entry` and :func:`report` build the
report documents the ``cli`` cases damage.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["HOSTILE_SURFACE_CASES", "report", "report_entry"]

Case = dict[str, Any]


def report_entry(verdict: Any = "PASS", cases: Any = None, **changes: Any) -> dict[str, Any]:
    """One ``reports[]`` entry of an ``opmux check --json`` report (passing by default)."""
    entry = {"op": "opmux::rms_norm", "provider": "cpp", "device": "cpu", "status": "checked",
             "reason": "", "ok": verdict != "FAIL", "verdict": verdict,
             "cases": [{"name": "fp32", "status": "pass", "max_abs": 1e-6, "max_rel": 0.0,
                        "ratio": 0.01, "atol": 1e-4, "rtol": 1e-4, "message": "",
                        "seconds": 0.0}] if cases is None else cases}
    entry.update(changes)
    return entry


def report(entries: Any = None, **changes: Any) -> dict[str, Any]:
    """An ``opmux check --json`` report (format 2) with ``entries`` and header ``changes``."""
    data = {"format": "opmux-check/2", "label": "lane", "platform": "cpu", "device": "cpu",
            "device_name": "CPU", "host": "h", "python": "3.11",
            "created": "2026-01-01T00:00:00+00:00", "versions": {"opmux": "0", "torch": "2"},
            "ok": True, "reports": [report_entry()] if entries is None else entries}
    data.update(changes)
    return data


def _matrix_cases() -> list[Case]:
    fail_case = {"name": "x", "status": "fail", "max_abs": 1.0, "ratio": 5.0}
    bad: list[tuple[str, Any, str]] = [
        ("cases-dict", report([report_entry(cases={"a": 1})]), "reports[0].cases"),
        ("cases-strings", report([report_entry(cases=["fp32", "bf16"])]),
         "reports[0].cases[0]"),
        ("cases-null", report([report_entry(cases=None, verdict="SKIP") | {"cases": None}]),
         "reports[0].cases"),
        ("case-status-int", report([report_entry(cases=[{"name": "a", "status": 1}])]),
         "reports[0].cases[0].status"),
        ("case-ratio-text", report([report_entry(cases=[{"name": "a", "status": "pass",
                                                         "ratio": "big"}])]),
         "reports[0].cases[0].ratio"),
        ("case-ratio-list", report([report_entry(cases=[{"name": "a", "status": "pass",
                                                         "ratio": [1]}])]),
         "reports[0].cases[0].ratio"),
        ("case-name-null", report([report_entry(cases=[{"name": None, "status": "pass"}])]),
         "reports[0].cases[0].name"),
        ("verdict-unknown", report([report_entry("PASSED")]), "reports[0].verdict"),
        ("verdict-lower", report([report_entry("pass")]), "reports[0].verdict"),
        ("verdict-null", report([report_entry(None)]), "reports[0].verdict"),
        ("verdict-fail-no-failure", report([report_entry("FAIL")]), "reports[0].verdict"),
        ("verdict-pass-with-failure", report([report_entry("PASS", [fail_case])]),
         "reports[0].verdict"),
        ("verdict-skip-with-pass", report([report_entry("SKIP")]), "reports[0].verdict"),
        ("provider-spaces", report([report_entry(provider="my provider")]),
         "reports[0].provider"),
        ("provider-slash", report([report_entry(provider="a/b")]), "reports[0].provider"),
        ("provider-int", report([report_entry(provider=7)]), "reports[0].provider"),
        ("op-empty", report([report_entry(op="")]), "reports[0].op"),
        ("op-list", report([report_entry(op=["x"])]), "reports[0].op"),
        ("entry-twice", report([report_entry(), report_entry()]), "reports[1]"),
        ("entry-string", report(["opmux::rms_norm"]), "reports[0]"),
        ("entry-ok-text", report([report_entry(ok="yes")]), "reports[0].ok"),
        ("reports-dict", report({"a": 1}), "field reports"),
        ("reports-missing", {k: v for k, v in report().items() if k != "reports"},
         "field reports"),
        ("label-empty", report(label=""), "field label"),
        ("label-blank", report(label="   "), "field label"),
        ("label-int", report(label=5), "field label"),
        ("platform-null", report(platform=None), "field platform"),
        ("device-name-missing", {k: v for k, v in report().items() if k != "device_name"},
         "field device_name"),
        ("versions-list", report(versions=["2.13"]), "field versions"),
        ("versions-int", report(versions={"torch": 2}), "versions.torch"),
        ("format-old-name", report(format="opmux-check"), "field format"),
        ("format-future", report(format="opmux-check/3"), "field format"),
        ("format-int", report(format=2), "field format"),
        ("top-list", [report()], "top level"),
        ("top-string", "report", "top level"),
        ("top-null", None, "top level"),
        ("created-int", report(created=2026), "field created"),
        ("ok-text", report(ok="true"), "field ok"),
    ]
    cases: list[Case] = [{"id": f"matrix-{name}", "kind": "cli", "report": doc,
                          "argv": ["matrix", "{report}"], "expect": expect}
                         for name, doc, expect in bad]
    raw = [("deep-list", "[" * 200_000 + "]" * 200_000, "nested too deep"),
           ("deep-object", "{\"a\":" * 100_000 + "1" + "}" * 100_000, "nested too deep"),
           ("not-utf8", "{\"label\": \"caf\udce9\"}", "not JSON"),
           ("truncated", "{\"format\": \"opmux-check/2\", \"reports\": [", "not JSON"),
           ("empty", "", "not JSON"), ("garbage", "\x00\x01\x02", "not JSON"),
           ("huge-int", "{\"format\": " + "9" * 5000 + "}", "not JSON")]
    cases += [{"id": f"matrix-raw-{name}", "kind": "cli", "report_raw": text,
               "argv": ["matrix", "{report}"], "expect": expect} for name, text, expect in raw]
    cases.append({"id": "matrix-raw-65mib", "kind": "cli", "report_blank_bytes": 65 << 20,
                  "argv": ["matrix", "{report}"], "expect": "larger than"})
    cases += [
        {"id": "matrix-json-nan", "kind": "cli", "code": 0, "expect": "",
         "report_raw": _nan_report(), "argv": ["matrix", "{report}", "--json"]},
        {"id": "matrix-missing", "kind": "cli", "argv": ["matrix", "{scratch}/none.json"],
         "expect": "no such file"},
        {"id": "matrix-a-folder", "kind": "cli", "argv": ["matrix", "{scratch}"],
         "expect": "unreadable"},
    ]
    return cases


def _nan_report() -> str:
    import json

    doc = report([report_entry("FAIL", [{"name": "x", "status": "fail", "max_abs": 1e400,
                                         "ratio": 1e400}])], format="opmux-check/1")
    return json.dumps(doc).replace("Infinity", "NaN", 1)


def _option_cases() -> list[Case]:
    devices = ["nonsense", "meta", "cuda", "cuda:99", "cpu:x", "", "\u00e9", "xla"]
    demo = ["demo", "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
            "--vocab", "64", "--steps", "1", "--batch", "1", "--model-dir", "{scratch}/m"]
    commands = {"check": ["check", "--op", "rms_norm"],
                "bench": ["bench", "--op", "rms_norm", "--repeat", "1"],
                "tune": ["tune", "--ops", "rms_norm", "--repeat", "1", "--dry-run"],
                "demo": demo}
    cases: list[Case] = []
    for command, argv in commands.items():
        for device in devices:
            cases.append({"id": f"{command}-device-{device or 'empty'}", "kind": "cli",
                          "argv": [*argv, "--device", device], "expect": "--device",
                          "cuda_ok": device.startswith("cuda") and device != "cuda:99"})
    cases += [
        {"id": f"bench-repeat-{r}", "kind": "cli", "argv": ["bench", "--repeat", r],
         "expect": "argument --repeat"} for r in ("0", "-3", "x", "1e9")]
    cases += [
        {"id": "check-label-blank", "kind": "cli", "argv": ["check", "--json", "--label", " "],
         "expect": "--label must not be empty"},
        {"id": "explain-extra-shape", "kind": "cli",
         "argv": ["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--shape", "9"],
         "expect": "takes 2 Tensor argument(s)"},
        {"id": "explain-extra-dtype", "kind": "cli",
         "argv": ["explain", "rms_norm", "--shape", "4,8", "--shape", "8", "--dtype", "bf16",
                  "--dtype", "bf16", "--dtype", "bf16"], "expect": "takes 2 Tensor argument(s)"},
        {"id": "explain-6gb-shape", "kind": "cli", "code": 0, "expect": "",
         "argv": ["explain", "rms_norm", "--shape", "40000,40000", "--shape", "40000",
                  "--json"]},
        {"id": "explain-meta-bad-weight", "kind": "cli",
         "argv": ["explain", "rms_norm", "--shape", "4,8", "--shape", "7", "--device", "meta"],
         "expect": "rejects these arguments"},
        {"id": "tune-clear-dry-run-json", "kind": "cli", "code": 0, "expect": "",
         "argv": ["tune", "--clear", "--dry-run", "--json"]},
    ]
    return cases


def _declare_cases() -> list[Case]:
    bad: list[tuple[str, Any, str]] = [
        ("bare-string", "hnd", "not a bare string"), ("bare-bytes", b"hnd", "not a bare string"),
        ("empty-list", [], "at least one format"), ("empty-string", "", "not a bare string"),
        ("int", 5, "got int"), ("none", None, "got NoneType"),
        ("list-of-int", ["hnd", 3], "non-empty strings"),
        ("list-with-empty", ["hnd", ""], "non-empty strings"),
        ("list-with-none", [None], "non-empty strings"),
        ("nested-list", [["hnd"]], "non-empty strings")]
    return [{"id": f"declare-{name}", "kind": "declare", "formats": formats, "expect": expect}
            for name, formats, expect in bad]


HOSTILE_SURFACE_CASES: Final[list[Case]] = _matrix_cases() + _option_cases() + _declare_cases()
"""Every case, ids unique."""
