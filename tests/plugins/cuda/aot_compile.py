"""Compile every Triton kernel of the CUDA plugin to a GPU binary without a GPU.

Run as a script in a process where the interpreter is OFF (``TRITON_INTERPRET`` unset):
``python aot_compile.py [--full] [arch ...]`` compiles each kernel down to a cubin through
Triton's own toolchain (ptxas ships with Triton) and prints one line per kernel. By default
every kernel and variant once in bf16 plus attention's fp32/fp16 dot paths (16 per arch);
``--full`` compiles every dtype x variant x attention tile (58 per arch, minutes). It catches
what the interpreter cannot: type errors in the GPU lowering, ``tl.dot`` shape limits,
unsupported ops. Exit status 1 on the first failure.
"""

from __future__ import annotations

import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_kernel(kernel: Any, pointers: dict[str, str], floats: tuple[str, ...],
                   constexprs: dict[str, Any], arch: int, num_warps: int = 4,
                   num_stages: int = 2) -> int:
    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    sig: dict[str, str] = {}
    consts: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            consts[(i,)] = constexprs[name]
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    missing = set(constexprs) - set(fn.arg_names)
    if missing:
        raise ValueError(f"{fn.__name__}: unknown constexprs {sorted(missing)}")
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return len(compiled.asm["cubin"])


def main(archs: list[int], full: bool = False) -> int:
    from opmux.plugins.cuda import (
        triton_activation,
        triton_attention,
        triton_cache,
        triton_norm,
        triton_rope,
    )

    jobs: list[tuple[str, Any, dict[str, str], tuple[str, ...], dict[str, Any], int]] = []
    for dt in ("fp32", "fp16", "bf16"):
        p = f"*{dt}"
        for act in (0, 1, 2):
            jobs.append((f"act_and_mul {dt} act={act}", triton_activation._act_and_mul_kernel,
                         {"x_ptr": p, "out_ptr": p}, (), {"ACT": act, "BLOCK": 1024}, 4))
        for res in (False, True):
            for single, block in ((True, 4096), (False, 16384)):
                jobs.append((f"rms_norm {dt} residual={res} single={single}",
                             triton_norm._rms_norm_kernel,
                             {"x_ptr": p, "res_ptr": p, "w_ptr": p, "out_ptr": p,
                              "res_out_ptr": p}, ("eps",),
                             {"HAS_RESIDUAL": res, "BLOCK": block, "SINGLE": single}, 8))
        for neox in (True, False):
            jobs.append((f"rope {dt} neox={neox}", triton_rope._rope_kernel,
                         {"pos_ptr": "*i64", "q_ptr": p, "k_ptr": p, "q_out_ptr": p,
                          "k_out_ptr": p, "cache_ptr": p}, (),
                         {"IS_NEOX": neox, "BLOCK_H": 8, "D_PAD": 128}, 4))
        jobs.append((f"reshape_and_cache {dt}", triton_cache._reshape_and_cache_kernel,
                     {"key_ptr": p, "value_ptr": p, "kc_ptr": p, "vc_ptr": p,
                      "slot_ptr": "*i64"}, (), {"BLOCK_H": 8, "D_PAD": 128}, 4))
        for group, window, cap in ((1, False, False), (4, True, True), (8, False, True)):
            for block_n in (32, 64, 128):
                jobs.append((f"paged_attention {dt} G={group} window={window} cap={cap} "
                             f"BLOCK_N={block_n}", triton_attention._paged_attention_kernel,
                             {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p,
                              "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32"},
                             ("scale", "soft_cap"),
                             {"G": group, "G_PAD": group, "BLOCK_Q": max(1, 16 // group),
                              "HEAD_D": 128, "D_PAD": 128, "USE_WINDOW": window,
                              "USE_SOFTCAP": cap, "FP32_DOT": dt == "fp32",
                              "BLOCK_N": block_n}, 4))
    jobs.append(("advance_step_flashattn", triton_cache._advance_step_kernel,
                 {"tokens_ptr": "*i64", "sampled_ptr": "*i64", "positions_ptr": "*i64",
                  "seq_lens_ptr": "*i32", "slots_ptr": "*i64", "block_tables_ptr": "*i32"},
                 (), {"BLOCK": 256}, 4))
    if not full:  # every kernel and variant once, bf16; the fp32/fp16 dot paths of attention
        jobs = [j for j in jobs if (" bf16" in j[0] and "BLOCK_N=128" not in j[0]
                                    and "BLOCK_N=32" not in j[0])
                or "advance_step" in j[0] or j[0].endswith("G=4 window=True cap=True BLOCK_N=64")]
    for arch in archs:
        for label, kernel, pointers, floats, consts, warps in jobs:
            try:
                size = compile_kernel(kernel, pointers, floats, consts, arch, warps)
            except Exception as exc:
                print(f"FAIL sm_{arch} {label}: {type(exc).__name__}: {exc}")
                return 1
            print(f"ok   sm_{arch} {label}: cubin {size} bytes")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main([int(a) for a in args if a != "--full"] or [90], full="--full" in args))
