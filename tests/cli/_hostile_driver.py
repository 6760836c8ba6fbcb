"""Runs cases of ``hostile_table`` and of :mod:`opmux.testing.hostile_surfaces` in this one
process, under ``RLIMIT_AS``, and prints one
JSON line of results per case (``python _hostile_driver.py WORKDIR HEADROOM_BYTES ID...``).

Each ``cli`` case calls :func:`opmux.cli.main` with stdout and stderr captured; each cache
case writes its file and records the warnings opmux gives and whether an op call still
works. Anything that escapes (an exception that is no exit) is recorded with its type, for
the parent to fail on.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any


def _limit(headroom: int) -> None:
    """``RLIMIT_AS`` = what the process maps now (torch loaded) + ``headroom``."""
    status = Path(f"/proc/{os.getpid()}/status").read_text()
    used = int(next(line for line in status.splitlines()
                    if line.startswith("VmSize:")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (used + headroom, used + headroom))


def _damage(ckpt: Path, spec: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    cfg_path = ckpt / "config.json"
    if "config" in spec:
        cfg = json.loads(cfg_path.read_text())
        cfg.update(spec["config"])
        cfg_path.write_text(json.dumps(cfg))
    if "config_raw_field" in spec:
        field, raw = spec["config_raw_field"]
        cfg = json.loads(cfg_path.read_text())
        cfg[field] = "@@RAW@@"
        cfg_path.write_text(json.dumps(cfg).replace('"@@RAW@@"', raw))
    if "config_raw" in spec:
        cfg_path.write_bytes(spec["config_raw"].encode("utf-8", "surrogateescape"))
    if "gen_raw" in spec:
        (ckpt / "generation_config.json").write_text(spec["gen_raw"])
    if "tokenizer_raw" in spec:
        (ckpt / "tokenizer.json").write_text(spec["tokenizer_raw"])
    weights = spec.get("weights")
    path = ckpt / "model.safetensors"
    if weights is None:
        return
    tensors = load_file(str(path))
    if weights == "truncate":
        path.write_bytes(path.read_bytes()[:-64])
    elif weights == "empty":
        path.write_bytes(b"")
    elif weights == "garbage":
        path.write_bytes(os.urandom(256))
    elif weights == "header-huge":
        path.write_bytes((2**60).to_bytes(8, "little") + b"{}")
    elif weights == "dir":
        (ckpt / "x.safetensors").mkdir()
    elif weights == "loop":
        (ckpt / "loop.safetensors").symlink_to(ckpt / "loop.safetensors")
    elif weights == "dangling":
        (ckpt / "gone.safetensors").symlink_to(ckpt / "nowhere")
    elif weights == "duplicate":
        save_file({"model.norm.weight": tensors["model.norm.weight"]},
                  str(ckpt / "model-2.safetensors"))
    elif weights in ("int-weights", "bool-weights"):
        dtype = torch.int32 if weights == "int-weights" else torch.bool
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
        save_file(tensors, str(path))
    elif weights == "missing":
        del tensors["model.norm.weight"]
        save_file(tensors, str(path))
    elif weights == "extra":
        tensors["model.surprise"] = torch.zeros(2)
        save_file(tensors, str(path))
    elif weights == "shape":
        tensors["model.norm.weight"] = torch.zeros(7)
        save_file(tensors, str(path))
    elif weights == "pickle-only":
        path.unlink()
        (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04.")
    elif weights == "none":
        path.unlink()
    elif weights == "model-is-file":
        shutil.rmtree(ckpt)
        ckpt.write_text("x")
    elif weights == "model-missing":
        shutil.rmtree(ckpt)


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _run_cli(case: dict[str, Any], work: Path, base: Path) -> dict[str, Any]:
    from opmux.cli import main

    ckpt = work / "ckpt"
    scratch = work / "scratch"
    full = work / "full"
    scratch.mkdir()
    full.mkdir()
    (full / "mine.txt").write_text("keep")
    (work / "file").write_text("x")
    shutil.copytree(base, ckpt)
    _damage(ckpt, case.get("ckpt", {}))
    report = work / "report.json"
    if "report" in case:
        report.write_text(json.dumps(case["report"]))
    elif "report_raw" in case:
        report.write_bytes(case["report_raw"].encode("utf-8", "surrogateescape"))
    elif "report_blank_bytes" in case:
        with open(report, "wb") as fh:
            fh.truncate(case["report_blank_bytes"])
    argv = [a.replace("{ckpt}", str(ckpt)).replace("{scratch}", str(scratch))
            .replace("{report}", str(report))
            .replace("{full}", str(full)).replace("{file}", str(work / "file"))
            for a in case["argv"]]
    saved = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    out, err = io.StringIO(), io.StringIO()
    result: dict[str, Any] = {"id": case["id"]}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            warnings.simplefilter("default")
            try:
                result["code"] = main(argv)
            except SystemExit as exc:
                result["code"] = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # what the parent fails on: it escaped the command
        result["escaped"] = f"{type(exc).__name__}: {exc}"[:300]
        result["traceback"] = traceback.format_exc()[-1500:]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    result["stdout"] = out.getvalue()[-2000:]
    result["stderr"] = err.getvalue()[-2000:]
    result["json"] = "--json" in argv
    result["written"] = _listing(scratch) + [f"full/{p}" for p in _listing(full)
                                              if p != "mine.txt"]
    return result


def _run_declare(case: dict[str, Any]) -> dict[str, Any]:
    import torch

    import opmux
    from opmux.ops.kv_formats import KVCacheSpec, kv_cache_formats_of

    spec = KVCacheSpec(torch.device("cpu"), torch.float32, 64, 2, 16)
    result: dict[str, Any] = {"id": case["id"]}
    try:
        opmux.declare_kv_cache_formats("hostile_provider", case["formats"])
        result["raised"] = None
    except opmux.RegistrationError as exc:
        result["raised"] = str(exc)
    except BaseException as exc:
        result["escaped"] = f"{type(exc).__name__}: {exc}"[:300]
        result["traceback"] = traceback.format_exc()[-1500:]
    result["formats_after"] = list(kv_cache_formats_of("hostile_provider", spec))
    return result


def _tuned_file(case: dict[str, Any], work: Path) -> Path:
    import opmux
    from opmux.core import tuned

    platform = opmux.current_platform()
    fp = tuned.fingerprint(opmux.global_registry(), platform)
    path = tuned.tuned_path(platform.name, tuned.fingerprint_id(fp))
    if "patch" in case:
        data = {"format": tuned.FORMAT, "platform": platform.name, "fingerprint": fp,
                "fingerprint_id": tuned.fingerprint_id(fp),
                "ops": {"opmux::silu_and_mul": {"order": ["native"]}}}
        text = json.dumps({**data, **case["patch"]}).replace("@OP", "opmux::silu_and_mul")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(case["content"].encode("utf-8", "surrogateescape"))
    return path


def _run_cache(case: dict[str, Any], work: Path) -> dict[str, Any]:
    import torch

    import opmux
    from opmux.core import trace, tuned
    from opmux.testing import reset_for_tests

    result: dict[str, Any] = {"id": case["id"]}
    os.environ["OPMUX_CACHE_DIR"] = str(work / "cache")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if case["kind"] == "tuned":
                reset_for_tests()
                os.environ["OPMUX_TUNED"] = "0"
                opmux.load_plugins()  # the fingerprint needs the providers
                path = _tuned_file(case, work)
                os.environ["OPMUX_TUNED"] = "1"
                reset_for_tests()
                opmux.load_plugins()
                result["state"] = tuned.tuned_status().state
                opmux.ops.silu_and_mul(torch.randn(2, 8))
            elif case["kind"] == "trace":
                path = work / "trace.json"
                path.write_bytes(case["content"].encode("utf-8", "surrogateescape"))
                os.environ["OPMUX_TRACE"] = str(path)
                trace.zero_counts()
                counted = trace.wrap("mylib::my_op", "fast", lambda a: a)
                counted(1)
                trace.flush()
                result["state"] = json.loads(path.read_text())
                del os.environ["OPMUX_TRACE"]
            else:
                from opmux.plugins import build_cache

                cache = build_cache.BuildCache("fake", "libfake.so", "fake library")

                def build(directory: Path) -> Path:
                    (directory / "libfake.so").write_bytes(b"\x7fELF" + b"x" * 64)
                    return directory / "libfake.so"

                lib = cache.ensure("k", build)
                path = lib.parent / build_cache.STAMP
                path.write_bytes(case["content"].encode("utf-8", "surrogateescape"))
                cache.ensure("k", build)
                result["state"] = build_cache.verify(lib.parent, "libfake.so")
                result["builds"] = cache.builds
    except BaseException as exc:
        result["escaped"] = f"{type(exc).__name__}: {exc}"[:300]
        result["traceback"] = traceback.format_exc()[-1500:]
        return result
    finally:
        os.environ.pop("OPMUX_TUNED", None)
    result["path"] = str(path)
    result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught
                          if issubclass(w.category, RuntimeWarning)]
    return result


def main() -> None:
    work_root, limit = Path(sys.argv[1]), int(sys.argv[2])
    ids = set(sys.argv[3:])
    sys.path.insert(0, str(Path(__file__).parent))
    import hostile_table
    import torch  # imported before the limit: its libraries map a lot of address space

    from opmux.models.synthetic import LlamaShape, write_random_llama

    torch.set_num_threads(1)
    base = write_random_llama(work_root / "base", LlamaShape(
        layers=1, hidden=32, heads=4, kv_heads=2, intermediate=32, vocab=64,
        max_position=64))
    _limit(limit)
    from opmux.testing.hostile_surfaces import HOSTILE_SURFACE_CASES

    for case in (hostile_table.CHECKPOINT_AND_CLI_CASES + hostile_table.CACHE_AND_TRACE_CASES
                 + HOSTILE_SURFACE_CASES):
        if case["id"] not in ids:
            continue
        work = work_root / f"case{len(list(work_root.iterdir()))}"
        work.mkdir()
        if case["kind"] == "cli":
            result = _run_cli(case, work, base)
        elif case["kind"] == "declare":
            result = _run_declare(case)
        else:
            result = _run_cache(case, work)
        if "{report}" in case.get("argv", []):
            (work / "report.json").unlink(missing_ok=True)  # the large ones, gone at once
        print(json.dumps(result), flush=True)
    children = [p for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == os.getpid()]
    print(json.dumps({"id": "__children__", "children": children}), flush=True)


def _ppid(pid: str) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


if __name__ == "__main__":
    main()
