"""``opmux tune``: time every supported provider per op and size bucket, write a priority table.

The inputs are the conformance kit's cases of each op (:mod:`opmux.testing`) plus shapes given
with ``--shape OP=4x256,256`` (zero-filled, float32, defaults for the other parameters). Cases
are grouped by size bucket (the bit length of the first argument's ``numel()``, as the hot
path picks them); in each bucket every provider is timed on the cases it accepts, interleaved
with native, and ranked by the geometric mean of its time over native's. A provider slower
than native is listed after it (it then never runs there). The table is written to
``$OPMUX_CACHE_DIR/tuned/<platform>-<fingerprint>.json`` and loaded by the next start-up as
the ``tuned`` priority layer (see :mod:`opmux.core.tuned`); ``OPMUX_PRIORITY`` and code
still override it. The table is for the platform's device: ``--device`` may only name a
device of that type (not ``meta``, nor another platform's), checked before any timing.
``--dry-run`` changes nothing, with ``--clear`` too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from typing import Any, Final

from opmux.cli._option_checks import int_in, run_device
from opmux.cli.strict_json import dumps
from opmux.cli.table import format_table

__all__ = ["HELP", "add_arguments", "measure_op", "run"]

HELP: Final = "time providers per op and size bucket; write the tuned priority table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``tune`` options to ``parser``."""
    parser.add_argument("--ops", default=None, metavar="OP,OP",
                        help="only these ops (comma-separated; default: every op with a "
                             "supported provider)")
    parser.add_argument("--shape", action="append", default=[], metavar="OP=AxB,C",
                        help="extra input: one shape per Tensor argument, e.g. "
                             "rms_norm=64x4096,4096 (repeatable)")
    parser.add_argument("--repeat", type=int_in(1, 100_000), default=9,
                        help="timed rounds (default 9)")
    parser.add_argument("--device", default=None,
                        help="device to time on: the platform's own (default), the one the "
                             "table is loaded for")
    parser.add_argument("--dry-run", action="store_true",
                        help="change nothing: measure and print (with --clear: list what "
                             "would be deleted)")
    parser.add_argument("--clear", action="store_true",
                        help="delete this platform's tuned tables and exit")
    parser.add_argument("--json", action="store_true", help="print JSON (strict: non-finite "
                                                            "numbers as \"inf\" or \"nan\")")


def _user_cases(ops: list[Any], specs: list[str], device: str) -> dict[str, list[Any]]:
    from opmux.cli.explain import op_args, parse_shape
    from opmux.core.errors import ConfigError

    by_name = {o.qualname: o for o in ops} | {o.name: o for o in ops if o.namespace == "opmux"}
    out: dict[str, list[Any]] = {}
    for spec in specs:
        name, sep, shapes = spec.partition("=")
        op = by_name.get(name.strip())
        if not sep or op is None:
            raise ConfigError(f"--shape {spec!r}: expected OP=AxB,C with OP one of the tuned "
                              f"ops {sorted(by_name)}")
        dims = [parse_shape(s, "x", f"--shape {spec!r}") for s in shapes.split(",")]
        args = op_args(op, dims, [], {}, device)
        out.setdefault(op.qualname, []).append(lambda a=args: (_clone(a), {}))
    return out


def _clone(args: list[Any]) -> tuple[Any, ...]:
    import torch

    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _accepts(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if impl.supports_args is None:
        return True
    try:
        return bool(impl.supports_args(*args, **kwargs))
    except Exception:  # a predicate that raises declines, as in dispatch
        return False


def measure_op(op: Any, makers: list[Any], repeat: int) -> dict[int, dict[str, Any]]:
    """Per size bucket: median ms of each provider on each accepted case, its score (geometric
    mean of time over native's) and the resulting order.

    :param makers: callables returning fresh ``(args, kwargs)`` (mutating ops change them).
    """
    import torch

    impls = {name: impl for name, impl in op.impls.items() if impl.supported}
    buckets: dict[int, dict[str, Any]] = {}
    for make in makers:
        args, kwargs = make()
        first = args[0] if args else None
        bits = int(first.numel()).bit_length() if isinstance(first, torch.Tensor) else 0
        accepted = [n for n, impl in impls.items() if _accepts(impl, args, kwargs)]
        times: dict[str, list[float]] = {n: [] for n in accepted}
        for round_ in range(repeat + 1):
            for name in accepted:
                a, k = make()  # outside the timer
                fn = impls[name].fn
                start = time.perf_counter()
                fn(*a, **k)
                if round_:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
        bucket = buckets.setdefault(bits, {"cases": 0, "ratios": {}, "ms": {}})
        bucket["cases"] += 1
        native = statistics.median(times["native"])
        for name, samples in times.items():
            ms = statistics.median(samples)
            bucket["ms"][name] = bucket["ms"].get(name, 0.0) + ms * 1e3
            bucket["ratios"].setdefault(name, []).append(ms / native if native > 0 else 1.0)
    for bucket in buckets.values():
        scores = {n: math.exp(statistics.fmean(math.log(max(r, 1e-9)) for r in rs))
                  for n, rs in bucket.pop("ratios").items()}
        bucket["speedup_vs_native"] = {n: 1.0 / s for n, s in scores.items()}
        ranked = sorted(scores, key=lambda n: (scores[n], n != "native"))
        bucket["order"] = ranked + [n for n in impls if n not in scores]
    return buckets


def _overall(buckets: dict[int, dict[str, Any]], providers: list[str]) -> list[str]:
    """One order for the op: providers by their geometric-mean speed-up over all buckets."""
    logs: dict[str, list[float]] = {}
    for bucket in buckets.values():
        for name, s in bucket["speedup_vs_native"].items():
            logs.setdefault(name, []).append(math.log(max(s, 1e-9)))
    score = {n: statistics.fmean(v) for n, v in logs.items()}
    ranked = sorted(score, key=lambda n: (-score[n], n != "native"))
    return ranked + [n for n in providers if n not in score]


def _clear(platform_name: str, dry_run: bool, as_json: bool) -> int:
    from opmux.core.tuned import tuned_dir

    folder = tuned_dir()
    tables = sorted(folder.glob(f"{platform_name}-*.json")) if folder.is_dir() else []
    if not dry_run:
        for path in tables:
            path.unlink()
    if as_json:
        print(dumps({"platform": platform_name, "folder": str(folder),
                     "tables": [str(p) for p in tables], "removed": not dry_run}))
        return 0
    verb = "would remove" if dry_run else "removed"
    print(f"{verb} {len(tables)} tuned table(s) of platform {platform_name!r} from {folder}")
    return 0


def _tune_device(text: str | None, platform: Any) -> str:
    """The device to time on: the platform's own; a table is loaded for that device only."""
    from opmux.core.errors import ConfigError

    if text is None:
        return str(platform.device_type)
    run_device(text, "tune")
    import torch

    kind = torch.device(text).type
    if kind != platform.device_type:
        raise ConfigError(f"opmux tune: --device {text!r}: the tuned table is for platform "
                          f"{platform.name!r}, which runs on {platform.device_type!r}; use "
                          f"--device {platform.device_type} (or leave --device out)")
    return text


def run(ns: argparse.Namespace) -> int:
    """Run ``opmux tune`` with parsed options; returns the exit status."""
    import opmux
    from opmux.cli.check import select_ops
    from opmux.core.errors import ConfigError
    from opmux.core.tuned import FORMAT, fingerprint, fingerprint_id, tuned_path
    from opmux.testing.cases import cases_for, has_cases

    platform = opmux.current_platform()
    if ns.clear:
        return _clear(platform.name, ns.dry_run, ns.json)
    device = _tune_device(ns.device, platform)
    names = [n.strip() for n in (ns.ops or "").split(",") if n.strip()]
    if ns.ops is not None and not names:
        raise ConfigError(f"opmux tune: --ops {ns.ops!r} names no op; give OP[,OP...] or leave "
                          f"--ops out to tune every op")
    ops = select_ops(names, "tune")
    if ops is None:
        return 2
    user = _user_cases(ops, ns.shape, device)
    table: dict[str, Any] = {}
    for op in ops:
        providers = [p for p, impl in op.impls.items() if impl.supported]
        makers = [lambda c=c: c.materialize(device)
                  for c in (cases_for(op.qualname) if has_cases(op.qualname) else [])]
        makers += user.get(op.qualname, [])
        if len(providers) < 2 or not makers:
            continue
        buckets = measure_op(op, makers, ns.repeat)
        table[op.qualname] = {"order": _overall(buckets, providers),
                              "buckets": {str(b): buckets[b] for b in sorted(buckets)}}
    fp = fingerprint(opmux.global_registry(), platform)
    path = tuned_path(platform.name, fingerprint_id(fp))
    data = {"format": FORMAT, "platform": platform.name, "fingerprint": fp,
            "fingerprint_id": fingerprint_id(fp),
            "created": datetime.datetime.now(datetime.timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%SZ"), "ops": table}
    if not ns.dry_run:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        tmp.replace(path)  # readers never see half a file
    if ns.json:
        print(dumps({**data, "path": str(path), "written": not ns.dry_run}))
        return 0
    rows = []
    for qualname, entry in table.items():
        for bits, bucket in entry["buckets"].items():
            lo = 0 if bits == "0" else 2 ** (int(bits) - 1)
            for name in bucket["order"]:
                if name in bucket["ms"]:
                    rows.append((qualname, f"{lo}..{2 ** int(bits) - 1}", name,
                                 f"{bucket['ms'][name]:.3f}",
                                 f"{bucket['speedup_vs_native'][name]:.2f}x"))
    print(format_table(rows, ("op", "numel of 1st arg", "provider", "ms (sum of cases)",
                              "vs native")))
    print()
    print(format_table([(q, ",".join(e["order"])) for q, e in table.items()],
                       ("op", "tuned order")))
    verb = "would write" if ns.dry_run else "wrote"
    print(f"\n{verb} {path} ({len(table)} op(s); median of {ns.repeat} interleaved rounds)",
          file=sys.stdout)
    return 0
