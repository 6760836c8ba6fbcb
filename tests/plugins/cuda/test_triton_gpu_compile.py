"""Every Triton kernel of the CUDA plugin lowers for sm_80, sm_90 and gfx942 without a GPU.

The interpreter runs the kernels' semantics on CPU but never lowers them. ``aot_compile.py``
(run here in a subprocess with the interpreter off) finds the kernels by walking the plugin's
modules, records the launches provider ``triton`` makes on the conformance cases, and lowers
every distinct variant through Triton's compiler for each target, checking shared memory and
registers against the target's limits. Triton's cache (``TRITON_CACHE_DIR``; the triton lane
points it into its environment folder) keeps the binaries by source hash, so a warm run is
much shorter than a cold one (every kernel changed; see docs/testing.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton

HERE = Path(__file__).parent


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when unset
    env.update(extra)
    return env


def test_every_kernel_lowers_for_every_target(tmp_path: Path) -> None:
    out = tmp_path / "lowered.json"
    proc = subprocess.run([sys.executable, str(HERE / "aot_compile.py"), "--json", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=3600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["unreached"] == [] and len(data["kernels"]) >= 39
    variants = data["variants"]
    # over a limit only as an autotune config the autotuner skips (gfx942's 64 KB LDS and
    # paged attention's largest fp32 tiles)
    assert all(v["status"] == "ok" or (v["status"] == "pruned" and v["groups"])
               for v in variants), [v for v in variants if v["status"] != "ok"]
    launched = {t: set(kernels) for t, kernels in data["launched"].items()}
    assert set(launched) == {"sm_80", "sm_90", "gfx942"}
    # every launchable kernel on sm_90 and gfx942; the fp8 kernels decline on sm_80
    assert launched["sm_90"] == launched["gfx942"] and len(launched["sm_90"]) >= 23
    fp8 = {v["kernel"] for v in variants
           if all(o.startswith("quant_fp8/") for o in v["origins"])}
    assert fp8 and launched["sm_80"] == launched["sm_90"] - fp8
    assert any(n.startswith("sm_80: quant_fp8/") and "declined" in n for n in data["notes"])
    # every autotune config of an autotuned kernel is lowered (paged attention has 5)
    attention = {(v["num_warps"], v["num_stages"], v["constexprs"].split("BLOCK_N=")[1])
                 for v in variants if v["kernel"].endswith("._paged_attention_kernel")}
    assert len(attention) == 5
    for target in ("sm_80", "sm_90"):
        dtypes = {v["signature"] for v in variants
                  if v["target"] == target and v["kernel"].endswith("._rms_norm_kernel")}
        assert {"*fp32", "*fp16", "*bf16"} <= {t for sig in dtypes for t in sig.split(",")}


_FAKE = '''
import triton
import triton.language as tl

from {pkg}.helpers_extra import _helper


@triton.jit
def _launched(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, _helper(tl.load(x_ptr + offs)))


@triton.jit
def _orphan(x_ptr):
    tl.store(x_ptr, 1.0)


@triton.jit
def _big(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(a_ptr + offs[:, None] * K + (k + offs)[None, :])
        b = tl.load(b_ptr + (k + offs)[:, None] * BLOCK + offs[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + offs[:, None] * BLOCK + offs[None, :], acc)
'''

_PROBE = '''
import json, sys
import aot_compile as a
from triton.compiler import ASTSource

kernels = a.enumerate_kernels("{pkg}")
launched = kernels["{pkg}.family_more._launched"]
big = kernels["{pkg}.family_more._big"]
src = ASTSource(big, {{"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "K": "i32",
                      "BLOCK": "constexpr"}}, {{(4,): 256}})
target = a.TARGETS["sm_90"]
options = a.make_options(target, num_warps=4, num_stages=4)
variant = a.compile_one(a.Variant("big", "sm_90", "", "BLOCK=256", 4, 4), src, options, target)
a.settle([variant])
print(json.dumps({{"kernels": sorted(kernels), "callees": sorted(a.callees(launched)),
                  "big": [variant.status, variant.message, variant.shared],
                  "regs": [a.block_registers(target, 255, 8), a.block_registers(target, 1, 1),
                           a.block_registers(a.TARGETS["gfx942"], 90, 8)]}}))
'''


def test_enumeration_limits_and_helpers(tmp_path: Path) -> None:
    """Kernels are found whatever the module names (a helper imported from another module is
    listed once, at home); a helper is reached through its caller; a block over the shared
    memory limit fails the check."""
    pkg = tmp_path / "fake_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers_extra.py").write_text(textwrap.dedent('''
        import triton

        @triton.jit
        def _helper(x):
            return x * 2.0
    '''))
    (pkg / "family_more.py").write_text(_FAKE.format(pkg="fake_kernels"))
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(HERE),
                                          os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(pkg="fake_kernels")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["kernels"] == ["fake_kernels.family_more._big", "fake_kernels.family_more._launched",
                              "fake_kernels.family_more._orphan",
                              "fake_kernels.helpers_extra._helper"]
    assert got["callees"] == ["fake_kernels.helpers_extra._helper"]
    status, message, shared = got["big"]
    assert status == "fail" and shared > 227 * 1024, got["big"]
    assert "per block" in message
    # 255 registers x 8 warps fill the 64K file exactly; one register still takes a warp's 256
    assert got["regs"] == [65536, 256, 4 * 2 * 96 * 64]
