"""The device check behind ``python benchmarks/gpu_kernels.py --check`` (``make gpu-check``).

One run on a CUDA machine, sized to finish in under 8 minutes on one H100:

1. **warm Triton's cache** for this GPU's architecture with the lowering check
   (``tests/plugins/cuda/aot_compile.py --target sm_XY --jobs N``, every CPU core): the
   conformance run and the benchmark then load the kernels the conformance cases launch
   instead of compiling them one at a time (a checkout without ``tests/`` skips this);
2. **conformance** of providers ``triton`` and ``cuda_c`` on the GPU against native on the
   CPU: ``opmux check --device cuda --json``, so ``opmux matrix`` merges the result with the
   CI lanes' reports;
3. **the GPU benchmark** of ``gpu_kernels.py``: achieved bandwidth as a share of the device's
   peak, speed against torch eager, ``torch.compile`` and the peers that are installed.

It writes ``gpu-check.json`` (the ``opmux check`` report, plus ``benchmark`` and ``phases``)
and ``gpu-check.md`` into the output folder. Exit status 1 when a provider fails conformance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOWERING = ROOT / "tests" / "plugins" / "cuda" / "aot_compile.py"
PROVIDERS = ("triton", "cuda_c")


def warm_cache(arch: str, jobs: int) -> str:
    """Lower the kernels for ``arch`` (``sm_90``) into Triton's cache; what happened."""
    if not LOWERING.exists():
        return f"skipped: {LOWERING} not in this checkout"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(LOWERING), "--target", arch, "--jobs", str(jobs)],
                          capture_output=True, text=True, env=env)
    if proc.returncode == 2 and "invalid choice" in proc.stderr:
        return f"skipped: the lowering check has no target {arch}"
    summary = [line for line in proc.stdout.splitlines() if line.startswith("summary:")]
    head = summary[-1] if summary else (proc.stdout + proc.stderr).strip()[-300:]
    return ("ok: " if proc.returncode == 0 else f"exit {proc.returncode}: ") + head


def conformance(device: str = "cuda", providers: tuple[str, ...] = PROVIDERS,
                label: str = "gpu", ops: tuple[str, ...] = ()) -> dict[str, Any]:
    """``opmux check --json`` of ``providers`` on ``device`` (a fresh process), parsed.

    :raises RuntimeError: ``opmux check`` could not run (exit status 2 or no report).
    """
    cmd = [sys.executable, "-m", "opmux.cli", "check", "--json", "--device", device,
           "--label", label]
    cmd += [f for p in providers for f in ("--provider", p)]
    cmd += [f for op in ops for f in ("--op", op)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode > 1:
        raise RuntimeError(f"opmux check exited {proc.returncode}: {proc.stderr.strip()}")
    payload: dict[str, Any] = json.loads(proc.stdout)
    return payload


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(report_path: Path, payload: dict[str, Any]) -> str:
    """The Markdown report: header, conformance matrix, benchmark table, phase times."""
    from opmux.cli import matrix

    lines = [f"# GPU check: {payload['device_name']}", "",
             f"{payload['created']}, host {payload['host']}; conformance "
             f"{'passed' if payload['ok'] else 'FAILED'}.", "", "## Conformance", "",
             matrix.format_markdown(matrix.merge([matrix.load_report(report_path)])), ""]
    bench = payload.get("benchmark")
    if bench:
        lines += ["## Benchmark", "",
                  f"Peak memory bandwidth {bench['peak_gbps']:.0f} GB/s "
                  f"({bench['peak_source']}); speed-up = baseline ms / best opmux ms.", "",
                  "| op | shape | contender | ms | GB/s | of peak | opmux speed-up | note |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in bench["rows"]:
            share = None if r["peak_share"] is None else 100 * r["peak_share"]
            lines.append(f"| {r['op']} | {r['shape']} | {r['contender']} | "
                         f"{_num(r['ms'], '.4f')} | {_num(r['gbps'], '.1f')} | "
                         f"{_num(share, '.1f')}{'%' if share is not None else ''} | "
                         f"{_num(r['speedup'], '.2f')} | {r['note'].replace('|', '/')} |")
        lines.append("")
    lines += ["## Phases", ""] + [f"- {name}: {info}" for name, info in
                                  payload.get("phases", {}).items()]
    return "\n".join(lines) + "\n"


def check_out(out: str | Path) -> Path:
    """``out`` as the report folder, checked before the run: an existing writable folder, or
    a path whose nearest existing parent is one (the folder is made when the report is
    written).

    :raises ValueError: a file in the way, or a folder that cannot be written, named.
    """
    folder = Path(out).expanduser()
    probe = folder
    while not probe.exists():
        if probe.is_symlink():  # a dangling link
            raise ValueError(f"--out {out}: {probe} is a link to nothing; choose a folder")
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--out {out}: {probe} is not a folder; choose a folder for the "
                         f"report")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: cannot write into {probe}; choose a folder you can "
                         f"write")
    return folder


def write_report(out: str | Path, payload: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``gpu-check.json`` and ``gpu-check.md`` into ``out``; their paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path = folder / "gpu-check.json", folder / "gpu-check.md"
    json_path.write_text(json.dumps(payload, indent=1))
    md_path.write_text(markdown(json_path, payload))
    return json_path, md_path


def device_check(out: str | Path, benchmark: Callable[[], dict[str, Any]]) -> int:
    """Run the three phases on the current CUDA device and write the report.

    :param benchmark: runs the benchmark, returns its facts and rows (``gpu_kernels.run``).
    """
    import torch

    phases: dict[str, str] = {}
    start = time.perf_counter()
    if torch.version.hip is None:
        arch = "sm_{}{}".format(*torch.cuda.get_device_capability(0))
    else:
        arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    t = time.perf_counter()
    note = warm_cache(arch, os.cpu_count() or 1)
    phases["triton cache"] = f"{time.perf_counter() - t:.0f} s, {note}"
    print(f"gpu-check: triton cache {phases['triton cache']}", flush=True)
    t = time.perf_counter()
    payload = conformance()
    bad = [f"{r['op']}:{r['provider']}" for r in payload["reports"] if not r["ok"]]
    phases["conformance"] = (f"{time.perf_counter() - t:.0f} s, {len(payload['reports'])} "
                             f"op x provider checks, {len(bad)} failed {bad or ''}".strip())
    print(f"gpu-check: conformance {phases['conformance']}", flush=True)
    t = time.perf_counter()
    payload["benchmark"] = benchmark()
    phases["benchmark"] = f"{time.perf_counter() - t:.0f} s"
    phases["total"] = f"{time.perf_counter() - start:.0f} s"
    payload["phases"] = phases
    json_path, md_path = write_report(out, payload)
    print(f"gpu-check: {phases['total']} in all; report {json_path} and {md_path}")
    return 1 if bad else 0
