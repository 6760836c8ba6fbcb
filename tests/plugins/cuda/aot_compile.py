"""Lower every Triton kernel of the CUDA plugin to GPU code without a GPU.

Run as a script with the interpreter OFF (``TRITON_INTERPRET`` unset)::

    python aot_compile.py [--target sm_80] [--target sm_90] [--target gfx942] [--json OUT]

1. **Enumerate**: every ``triton.JITFunction`` defined in a module of the package (found by
   walking it, whatever the modules are called), autotuned or not.
2. **Record**: provider ``triton`` runs on every conformance case of every op it serves, with
   the launch methods of ``JITFunction`` and ``Autotuner`` replaced by a recorder: the host
   code runs (shapes, dtypes, strides, constexprs) and no kernel does. The interpreter is
   off, so the module-level choices that depend on it (the autotune config lists, the
   interpreter-only dot and rounding paths) are the ones a GPU process makes.
3. **Lower**: each recorded launch is bound for each target as ``JITFunction.run`` binds it
   on a device (signature, constexprs, 16-byte alignment and divisibility attributes,
   options), an autotuned launch once per config; the distinct variants are compiled with
   ``triton.compile``. Triton's cache (``TRITON_CACHE_DIR``) keys each by the kernel's source
   hash, so an unchanged kernel is not compiled again.
4. **Check** the compiled metadata against the target: shared memory within the per-block
   maximum, registers x threads of the launched block within the register file. An autotune
   config over a limit is only reported when every call it serves has a config that fits
   (on a device the autotuner skips a config that raises OutOfResources).
5. **Coverage**: every enumerated kernel is launched, or called by a launched kernel; a kernel
   no conformance case reaches is an error (add a case).

Prints one line per variant and a summary; ``--json`` writes the results. Exit status 1 when
any variant fails to lower, breaks a limit, or a kernel is never reached.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

PACKAGE = "opmux.plugins.cuda"
PROVIDER = "triton"


@dataclass(frozen=True)
class Target:
    """A GPU target and the per-block limits its compiled kernels must respect."""

    name: str
    backend: str
    arch: int | str
    warp_size: int
    #: largest shared memory (LDS) one block may use, bytes (with the opt-in Triton makes)
    max_shared: int
    #: registers a block may hold (the SM's / CU's register file for one block)
    max_block_regs: int
    #: allocation unit: NVIDIA allocates a warp's registers 256 at a time, AMD a lane's VGPRs
    #: 8 at a time
    reg_unit: int


TARGETS: dict[str, Target] = {
    # CUDA C Programming Guide, "Technical Specifications per Compute Capability":
    # 163 KB (8.0) and 227 KB (9.0) of shared memory per block, 64K 32-bit registers.
    "sm_80": Target("sm_80", "cuda", 80, 32, 163 * 1024, 65536, 256),
    "sm_90": Target("sm_90", "cuda", 90, 32, 227 * 1024, 65536, 256),
    # CDNA3 (MI300): 64 KB LDS per workgroup; 512 VGPRs per lane per SIMD, 4 SIMDs per CU.
    "gfx942": Target("gfx942", "hip", "gfx942", 64, 64 * 1024, 4 * 512 * 64, 8),
}


# --------------------------------------------------------------------------- enumerate


def _is_kernel(obj: Any) -> bool:
    import triton

    return isinstance(obj, triton.JITFunction | triton.runtime.Autotuner
                      | triton.runtime.Heuristics)


def _base(obj: Any) -> Any:
    """The ``JITFunction`` under autotune/heuristics wrappers."""
    import triton

    while not isinstance(obj, triton.JITFunction):
        obj = obj.fn
    return obj


def kernel_name(fn: Any) -> str:
    return f"{fn.__module__}.{fn.__name__}"


def enumerate_kernels(package: str = PACKAGE) -> dict[str, Any]:
    """Every ``JITFunction`` defined in a module of ``package`` (walked recursively), by
    ``module.name``; a kernel a module imports from another is listed once, at its home."""
    pkg = importlib.import_module(package)
    modules = [pkg] + [importlib.import_module(m.name)
                       for m in pkgutil.walk_packages(pkg.__path__, f"{package}.")]
    found: dict[str, Any] = {}
    for module in modules:
        for obj in vars(module).values():
            if _is_kernel(obj):
                fn = _base(obj)
                if fn.__module__ == module.__name__:
                    found[kernel_name(fn)] = fn
    return dict(sorted(found.items()))


def callees(fn: Any) -> set[str]:
    """Kernels ``fn`` calls (by name lookup in its module), transitively."""
    import triton

    seen: set[str] = set()
    todo = [fn]
    while todo:
        cur = todo.pop()
        tree = ast.parse(textwrap.dedent(cur.src))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                target = cur.__globals__.get(node.func.id)
                if isinstance(target, triton.JITFunction):
                    name = kernel_name(target)
                    if name not in seen:
                        seen.add(name)
                        todo.append(target)
    return seen


# --------------------------------------------------------------------------- record


@dataclass
class Launch:
    """One kernel launch the provider made (an autotuned launch: one per config)."""

    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    origin: str
    #: the autotuned call this launch is one config of (``None``: not autotuned)
    group: int | None = None


class Recorder:
    """Replaces ``JITFunction.run`` and ``Autotuner.run`` while active: a launch is recorded,
    not run; an autotuned launch is recorded once per config the autotuner would try."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.origin = ""
        self.group: int | None = None
        self.groups = 0

    @contextmanager
    def active(self) -> Iterator[Recorder]:
        from triton.runtime import Autotuner, JITFunction

        recorder = self

        def jit_run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            recorder.launches.append(Launch(fn, args, kwargs, recorder.origin, recorder.group))

        def tuned_run(tuner: Any, *args: Any, **kwargs: Any) -> None:
            tuner.nargs = dict(zip(tuner.arg_names, args, strict=False))
            recorder.groups += 1
            recorder.group = recorder.groups
            try:
                for config in tuner.prune_configs(kwargs):
                    tuner.fn.run(*args, **kwargs, **config.all_kwargs())
            finally:
                recorder.group = None

        saved = JITFunction.run, Autotuner.run
        JITFunction.run, Autotuner.run = jit_run, tuned_run
        try:
            yield self
        finally:
            JITFunction.run, Autotuner.run = saved


@functools.cache
def _served() -> list[str]:
    """Register provider ``triton`` on the catalog (once), as on a CUDA machine; the ops."""
    import opmux
    from opmux.plugins.cuda import triton_ops

    class _Catalog:
        def list_ops(self) -> list[Any]:
            return opmux.list_ops()

    return sorted(pair.split(":")[0] for pair in triton_ops.register(_Catalog(), "CUDA"))


def record_launches(capability: tuple[int, int] | None) -> tuple[list[Launch], list[str]]:
    """Run provider ``triton`` on every conformance case of every op it serves, as on a GPU
    of compute ``capability`` (``None``: not an NVIDIA GPU), launches recorded.

    :return: the launches, and one line per case the provider declined or raised on.
    """
    from unittest import mock

    import opmux
    from opmux.plugins.cuda import triton_runtime
    from opmux.testing import cases_for, has_cases

    served = _served()
    notes: list[str] = []
    recorder = Recorder()
    with recorder.active(), mock.patch.object(triton_runtime, "cuda_capability",
                                              lambda t: capability):
        for name in served:
            op = opmux.get_op(name)
            impl = op.impls[PROVIDER]
            if not has_cases(op.qualname):
                notes.append(f"{name}: no conformance cases (its kernels cannot be lowered)")
                continue
            for case in cases_for(op.qualname):
                args, kwargs = case.materialize("cpu")
                if impl.supports_args is not None and not impl.supports_args(*args, **kwargs):
                    notes.append(f"{name}/{case.name}: declined by supports_args")
                    continue
                recorder.origin = f"{name}/{case.name}"
                try:
                    impl.fn(*args, **kwargs)
                except Exception as exc:
                    notes.append(f"{name}/{case.name}: raised {type(exc).__name__}: {exc}")
    return recorder.launches, notes


# --------------------------------------------------------------------------- lower


@dataclass
class Variant:
    """One distinct compilation: kernel x target x signature x constexprs x options."""

    kernel: str
    target: str
    signature: str
    constexprs: str
    num_warps: int
    num_stages: int
    origins: list[str] = field(default_factory=list)
    #: the autotuned calls it is a config of (see :func:`settle`)
    groups: list[int] = field(default_factory=list)
    #: ``ok``; ``fail`` (does not lower, or over a limit); ``pruned`` (an autotune config over
    #: a limit where every call it serves has a config that fits: the autotuner skips it on a
    #: device, as it skips any config that raises OutOfResources); ``over`` before settling
    status: str = "pending"
    message: str = ""
    shared: int = 0
    registers: int = 0
    local_bytes: int = 0
    seconds: float = 0.0

    def label(self) -> str:
        return (f"{self.target} {self.kernel.rsplit('.', 1)[-1]} [{self.constexprs}] "
                f"warps={self.num_warps} stages={self.num_stages}")


def gpu_target(target: Target) -> Any:
    """Triton's ``GPUTarget`` of ``target``."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget(target.backend, target.arch, target.warp_size)


def make_options(target: Target, **options: Any) -> Any:
    """The backend options of ``target`` with ``options`` set (``num_warps=8``, ...)."""
    from triton.compiler import make_backend

    return make_backend(gpu_target(target)).parse_options(options)


def bind(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: Target,
         binders: dict[tuple[int, str], Any]) -> tuple[Any, Any]:
    """``(ASTSource, options)`` of a launch for ``target``, made as ``JITFunction.run`` makes
    them on a device (the binding steps of Triton 3.9)."""
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    key = (id(fn), target.name)
    if key not in binders:
        backend = make_backend(gpu_target(target))
        binders[key] = backend, create_function_from_signature(fn.signature, fn.params, backend)
    backend, binder = binders[key]
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                         specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options


def plan(launches: list[Launch], target: Target) -> list[tuple[Variant, Any, Any]]:
    """The distinct variants of ``launches`` for ``target``: ``(variant, source, options)``."""
    binders: dict[tuple[int, str], Any] = {}
    out: dict[tuple[str, str], tuple[Variant, Any, Any]] = {}
    for launch in launches:
        src, options = bind(launch.fn, launch.args, launch.kwargs, target, binders)
        key = (src.hash(), options.hash())
        if key not in out:
            names = list(src.signature)
            sig = ",".join(sorted({t for t in src.signature.values() if t != "constexpr"}))
            consts = " ".join(f"{names[p[0]]}={v}" for p, v in sorted(src.constants.items())
                              if len(p) == 1)
            out[key] = (Variant(kernel_name(launch.fn), target.name, sig, consts,
                                options.num_warps, options.num_stages), src, options)
        variant = out[key][0]
        if launch.origin not in variant.origins:
            variant.origins.append(launch.origin)
        if launch.group is not None and launch.group not in variant.groups:
            variant.groups.append(launch.group)
    return list(out.values())


_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resources(target: Target, compiled: Any) -> tuple[int, int, int]:
    """``(registers per thread, static shared bytes, spills)``: NVIDIA from the cubin through
    the ``cuobjdump`` Triton ships (spills: local memory bytes per thread), AMD from the
    assembly (spills: spilled VGPRs)."""
    if target.backend == "cuda":
        from triton import knobs

        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage",
                                  f.name], capture_output=True, text=True, check=True).stdout
        match = _RESOURCES.search(out)
        if match is None:
            raise RuntimeError(f"cuobjdump printed no resource usage: {out!r}")
        regs, stack, shared, local = (int(g) for g in match.groups())
        return regs, shared, max(stack, local)
    asm = compiled.asm["amdgcn"]
    # VGPRs and AGPRs share one file on CDNA: the total counts
    vgprs = (re.search(r"; TotalNumVgprs: (\d+)", asm)
             or re.search(r"\.vgpr_count:\s+(\d+)", asm))
    spills = re.search(r"\.vgpr_spill_count:\s+(\d+)", asm)
    if vgprs is None:
        raise RuntimeError("no .vgpr_count in the AMDGCN assembly")
    return int(vgprs.group(1)), 0, int(spills.group(1)) if spills else 0


def block_registers(target: Target, regs: int, num_warps: int) -> int:
    """Registers the launched block occupies, in the allocation units of ``target``. NVIDIA:
    per warp, rounded up to 256; AMD: the waves of a workgroup spread over the CU's 4 SIMDs,
    each wave's VGPRs rounded up to 8 (so one SIMD's 512 fit ``4 x 512 x 64`` in all)."""
    if target.backend == "cuda":
        per_warp = -(-regs * target.warp_size // target.reg_unit) * target.reg_unit
        return per_warp * num_warps
    waves_per_simd = -(-num_warps // 4)
    per_lane = -(-regs // target.reg_unit) * target.reg_unit
    return 4 * waves_per_simd * per_lane * target.warp_size


def compile_one(variant: Variant, src: Any, options: Any, target: Target) -> Variant:
    """Compile one variant and check it against ``target``'s limits (fills ``variant``)."""
    import triton

    start = time.perf_counter()
    try:
        compiled = triton.compile(src, target=gpu_target(target), options=options.__dict__)
        regs, static_shared, local = resources(target, compiled)
    except Exception as exc:
        variant.status = "fail"
        variant.message = f"{type(exc).__name__}: {exc}".strip().replace("\n", " | ")[:600]
        return variant
    finally:
        variant.seconds = time.perf_counter() - start
    variant.shared = int(compiled.metadata.shared) + static_shared
    variant.registers, variant.local_bytes = regs, local
    problems = []
    if variant.shared > target.max_shared:
        problems.append(f"shared memory {variant.shared} B > {target.max_shared} B per block")
    used = block_registers(target, regs, variant.num_warps)
    if used > target.max_block_regs:
        problems.append(f"{regs} registers/thread x {variant.num_warps} warps = {used} > "
                        f"{target.max_block_regs} per block")
    variant.status = "over" if problems else "ok"
    variant.message = "; ".join(problems)
    return variant


def settle(variants: list[Variant]) -> None:
    """Decide the variants over a limit: ``pruned`` where each autotuned call the variant is
    a config of has a config that fits on the same target, else ``fail``."""
    fits: dict[tuple[str, int], bool] = {}
    for v in variants:
        for g in v.groups:
            fits[(v.target, g)] = fits.get((v.target, g), False) or v.status == "ok"
    for v in variants:
        if v.status == "over":
            pruned = bool(v.groups) and all(fits[(v.target, g)] for g in v.groups)
            v.status = "pruned" if pruned else "fail"
            v.message += (" (an autotune config: the autotuner skips it, another fits)"
                          if pruned else "")


_JOBS: list[tuple[Variant, Any, Any, Target]] = []
"""The work list, set before the pool forks (its workers inherit it)."""


def _compile_index(i: int) -> Variant:
    variant, src, options, target = _JOBS[i]
    return compile_one(variant, src, options, target)


def lower(targets: list[Target], jobs: int, only: re.Pattern[str] | None = None
          ) -> tuple[list[Variant], list[str], set[str]]:
    """Record, plan and compile for every target (only the kernels ``only`` matches).

    :return: the variants, the recording notes (per target), and the kernels launched or
        called by a launched kernel on some target.
    """
    import multiprocessing

    notes: list[str] = []
    reached: set[str] = set()
    _JOBS.clear()
    for target in targets:
        capability = divmod(int(target.arch), 10) if target.backend == "cuda" else None
        launches, target_notes = record_launches(capability)
        notes += [f"{target.name}: {n}" for n in target_notes]
        for fn in {id(launch.fn): launch.fn for launch in launches}.values():
            reached |= {kernel_name(fn)} | callees(fn)
        _JOBS.extend((v, src, opt, target) for v, src, opt in plan(launches, target)
                     if only is None or only.search(v.kernel))
    # the slowest first, so the tail stays short
    order = sorted(range(len(_JOBS)), key=lambda i: "attention" not in _JOBS[i][0].kernel)
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            done = pool.map(_compile_index, order, chunksize=1)
    else:
        done = [_compile_index(i) for i in order]
    settle(done)
    return done, notes, reached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help="target to lower for (repeatable; default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compiler processes (default: one per CPU)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--kernel", metavar="REGEX", default="",
                        help="lower only the kernels whose name matches (after editing one); "
                             "the coverage check is skipped then")
    ns = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_compile: unset TRITON_INTERPRET (kernels must be JITFunctions to lower)")
        return 2
    targets = [TARGETS[t] for t in (ns.target or sorted(TARGETS))]
    start = time.perf_counter()
    kernels = enumerate_kernels()
    variants, notes, reached = lower(targets, ns.jobs, re.compile(ns.kernel))
    for v in sorted(variants, key=lambda v: (v.target, v.kernel, v.constexprs)):
        head = {"ok": "ok  ", "pruned": "skip"}.get(v.status, "FAIL")
        print(f"{head} {v.label()}: regs {v.registers} shared {v.shared} B local {v.local_bytes}"
              f" B ({v.seconds:.1f} s)" + (f": {v.message}" if v.message else ""))
    for note in notes:
        print(f"note {note}")
    unreached = [] if ns.kernel else sorted(set(kernels) - reached)
    for name in unreached:
        print(f"FAIL {name}: no conformance case launches it (add a case for its op)")
    per_target = {t.name: sorted({v.kernel for v in variants if v.target == t.name})
                  for t in targets}
    failed = [v for v in variants if v.status not in ("ok", "pruned")]
    pruned = sum(v.status == "pruned" for v in variants)
    seconds = time.perf_counter() - start
    print(f"summary: {len(kernels)} kernels enumerated ({len(kernels) - len(unreached)} "
          f"reached); {len(variants)} variants on {', '.join(per_target)}; "
          f"{pruned} autotune configs over a limit (skipped by the autotuner); "
          f"{len(failed)} failed; {seconds:.0f} s")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"kernels": list(kernels), "unreached": unreached,
                       "launched": per_target, "notes": notes, "seconds": seconds,
                       "variants": [asdict(v) for v in variants]}, f, indent=1)
    return 1 if failed or unreached else 0


if __name__ == "__main__":
    sys.exit(main())
