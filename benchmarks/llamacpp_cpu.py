"""opmux's ``Engine`` against llama.cpp and ``transformers`` on random Llama checkpoints (CPU),
with the memory-bandwidth and GEMM rooflines measured in the same run.

One run writes seeded random ``LlamaForCausalLM`` checkpoints (``opmux.models.synthetic``):
``100m`` (``LLAMA_100M``: 8 layers, hidden 768, 12/4 heads, intermediate 2048, vocab 32000)
and ``tiny`` (2 layers, hidden 256, 8/2 heads, intermediate 512, vocab 4000), converts each to
GGUF with the ``gguf`` package (F32 for float32, BF16 for bfloat16; the q/k rows permuted to
llama.cpp's rotary layout; no tokenizer: prompts are token ids) and loads it in llama.cpp
through ``llama-cpp-python``'s ``llama_cpp`` C API (``llama_batch`` / ``llama_decode``:
batched greedy decode of many sequences, no sampler; flash attention off, a KV cache of the
model's dtype). Every cell (size, dtype, threads, batch) runs the three engines on the same
``--prompt-len``-token prompts for ``--new-tokens`` greedy tokens, alternating within each of
``--rounds`` rounds, and prints the best **decode** tokens/s of each: the clock is read as
each step's tokens come out (llama.cpp: after each ``llama_decode`` and its argmax;
``transformers``: each call of a logits processor; opmux: the ``Engine``'s ``progress``
callback, from its first decode step on), and the rate is ``batch`` tokens per step over the
steps between the first reading and the last (the prefill left out). The clock is wall time,
or with ``--clock thread`` (one thread only) the calling thread's CPU time, which other
processes on a shared machine do not inflate (all three run their one thread's work on the
calling thread). Threads: ``torch.set_num_threads`` for opmux and ``transformers``,
``n_threads`` for llama.cpp.

Rooflines, measured in the run at each thread count (the best of 10 calls, on the same clock:
a ceiling): the **bandwidth roofline** is a 128 MiB copy's GB/s (read + write) divided by the
weight bytes a decode step reads (every layer's weights, the final norm and the LM head; not
the embedding table), the batch-1 ceiling; the **GEMM roofline** is ``torch.mm``'s float32
rate on 1024² operands divided by the 2 FLOPs per weight a token costs, the ceiling at batch
16 (bfloat16 has no native compute on CPUs without AVX-512 BF16 / AMX, so float32's rate is
the ceiling there too). In float32 the script checks that opmux's greedy tokens equal
``transformers``' (it stops otherwise) and prints how many of llama.cpp's rows equal them.
The last line names the goals a run missed: ahead of ``transformers`` in every cell, and at
the 100m size at least llama.cpp's rate, 85 % of the bandwidth roofline at batch 1 and 50 % of
the GEMM roofline at batch 16 (the tiny size's weights sit in the caches: its ratios are
reported).

Run: ``make bench-llamacpp`` (the ``llamacpp`` lane: llama-cpp-python builds llama.cpp from
source with ``-march=native``), or in that lane ``python benchmarks/llamacpp_cpu.py [--sizes
100m tiny] [--dtype float32 bfloat16] [--threads 1 2] [--batch 1 16] [--prompt-len 32]
[--new-tokens 32] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import llama_cpp as lc
import numpy as np
import torch
from safetensors.torch import load_file
from timing import require_cpu_plugin

from opmux.models import Engine, load_model
from opmux.models.synthetic import LLAMA_100M, LlamaShape, write_random_llama
from opmux.testing.vllm_generate import token_prompts

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SHAPES = {
    "100m": LLAMA_100M,
    "tiny": LlamaShape(layers=2, hidden=256, heads=8, kv_heads=2, intermediate=512,
                       vocab=4000),
}
_REPORTED = ("tiny",)
"""Sizes whose weights sit in the caches, where per-step overhead decides: their ratios to
llama.cpp and their rooflines are reported, and only the lead over ``transformers`` is a
goal."""
_GGML_TYPE = {"float32": gguf.GGMLQuantizationType.F32,
              "bfloat16": gguf.GGMLQuantizationType.BF16}
_FILE_TYPE = {"float32": gguf.LlamaFileType.ALL_F32, "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def _rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from the half-split rotary layout (Hugging Face) to interleaved pairs (GGML)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).transpose(1, 2).reshape(w.shape)


def write_gguf(checkpoint: Path, out: Path, dtype: str) -> Path:
    """The checkpoint as a llama-architecture GGUF, matrices in ``dtype`` (norms F32)."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("no_vocab")
    w.add_file_type(_FILE_TYPE[dtype])
    for name, t in load_file(str(checkpoint / "model.safetensors")).items():
        t = t.float()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, layer, module = name.removesuffix(".weight").split(".", 3)
            gname = f"blk.{layer}.{_GGUF_NAMES[module]}.weight"
            if module == "self_attn.q_proj":
                t = _rope_rows(t, heads)
            elif module == "self_attn.k_proj":
                t = _rope_rows(t, kv_heads)
        if t.dim() == 1 or dtype == "float32":
            w.add_tensor(gname, t.numpy())
        else:  # the bits of torch's own bfloat16 rounding, as opmux and transformers load it
            bits = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(gname, bits, raw_dtype=_GGML_TYPE[dtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@lc.llama_log_callback  # type: ignore[misc]
def _quiet(level: int, text: bytes, data: Any) -> None:
    """llama.cpp's log, dropped."""


class LlamaCpp:
    """A GGUF model in llama.cpp; :meth:`generate` decodes many sequences in one batch."""

    def __init__(self, path: Path, dtype: str) -> None:
        lc.llama_log_set(_quiet, ctypes.c_void_p(0))
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(str(path).encode(),
                                                   lc.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.kv_type = int(_GGML_TYPE[dtype])
        self.ctx: Any = None
        self.shape = (0, 0, 0)

    def _context(self, batch: int, tokens: int, threads: int) -> Any:
        if self.shape != (batch, tokens, threads):
            if self.ctx:
                lc.llama_free(self.ctx)
            p = lc.llama_context_default_params()
            p.n_ctx = batch * tokens
            p.n_batch = p.n_ubatch = max(batch * tokens, 512)
            p.n_seq_max = batch
            p.n_threads = p.n_threads_batch = threads
            p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
            p.type_k = p.type_v = self.kv_type
            p.no_perf = True
            self.ctx = lc.llama_init_from_model(self.model, p)
            if not self.ctx:
                raise SystemExit("llama.cpp could not create its context")
            self.shape = (batch, tokens, threads)
        return self.ctx

    def generate(self, prompts: list[list[int]], n: int, threads: int,
                 clock: Callable[[], float]) -> tuple[list[list[int]], list[float]]:
        """Greedy ids after each prompt, and the clock read after each step."""
        s, plen = len(prompts), len(prompts[0])
        ctx = self._context(s, plen + n, threads)
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        b = lc.llama_batch_init(s * plen, 0, 1)
        try:
            k = 0
            for seq, prompt in enumerate(prompts):
                for pos, tok in enumerate(prompt):
                    b.token[k], b.pos[k], b.n_seq_id[k] = tok, pos, 1
                    b.seq_id[k][0], b.logits[k] = seq, pos == plen - 1
                    k += 1
            b.n_tokens = k
            rows: list[list[int]] = [[] for _ in range(s)]
            stamps = []
            for step in range(n):
                if lc.llama_decode(ctx, b) != 0:
                    raise SystemExit("llama_decode failed")
                logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(s, self.vocab))
                picked = logits.argmax(axis=1).tolist()
                stamps.append(clock())
                for seq, tok in enumerate(picked):
                    rows[seq].append(tok)
                    b.token[seq], b.pos[seq], b.n_seq_id[seq] = tok, plen + step, 1
                    b.seq_id[seq][0], b.logits[seq] = seq, True
                b.n_tokens = s
            return rows, stamps
        finally:
            lc.llama_batch_free(b)


def _transformers(model: Any, prompts: list[list[int]], n: int, clock: Callable[[], float]
                  ) -> tuple[list[list[int]], list[float]]:
    stamps: list[float] = []

    def stamp(_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        stamps.append(clock())
        return scores

    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0,
                             logits_processor=[stamp])
    rows: list[list[int]] = out[:, ids.shape[1]:].tolist()
    return rows, stamps


def _step_weights(shape: LlamaShape) -> int:
    """The weights one decode step reads (all but the embedding table)."""
    return shape.num_parameters() - shape.vocab * shape.hidden


def _best_s(fn: Callable[[], object], clock: Callable[[], float], calls: int = 10) -> float:
    """The fastest of ``calls`` timed calls after one warm-up (a ceiling: the least
    disturbed call on a shared machine)."""
    fn()
    best = float("inf")
    for _ in range(calls):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def _copy_gbps(clock: Callable[[], float]) -> float:
    src = torch.randn(32 * 1024 * 1024)  # 128 MiB, read and written
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_s(lambda: dst.copy_(src), clock) / 1e9


def _mm_gflops(clock: Callable[[], float]) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 2 * 1024**3 / _best_s(lambda: torch.mm(a, b), clock) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["100m", "tiny"], choices=list(_SHAPES))
    parser.add_argument("--dtype", nargs="+", default=list(_DTYPES), choices=list(_DTYPES))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: the calling thread's CPU time (needs --threads 1)")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != [1]:
        parser.error("--clock thread needs --threads 1 (other threads' work is not counted)")
    import transformers

    require_cpu_plugin()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    roofs = {}
    for t in args.threads:
        torch.set_num_threads(t)
        roofs[t] = (_copy_gbps(clock), _mm_gflops(clock))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, llama.cpp "
          f"(llama-cpp-python {lc.__version__}); prompt {args.prompt_len}, {args.new_tokens} "
          f"new tokens; decode tokens/s, best of {args.rounds} alternating rounds, "
          f"{args.clock} clock")
    for t, (gbps, gflops) in roofs.items():
        print(f"{t} thread(s): copy {gbps:.1f} GB/s, torch.mm float32 {gflops:.1f} GFLOP/s")
    print(f"{'size':>5} {'dtype':>9} {'thr':>3} {'batch':>5} {'opmux':>8} {'llama.cpp':>9} "
          f"{'transformers':>12} {'/llama.cpp':>10} {'/transf.':>8} {'roofline':>8} "
          f"{'opmux %':>7} {'llama %':>7}  tokens")
    misses: list[str] = []
    with tempfile.TemporaryDirectory(prefix="opmux-llamacpp-") as tmp:
        for size in args.sizes:
            shape = _SHAPES[size]
            ckpt = write_random_llama(Path(tmp) / size, shape, seed=0)
            for dtype_name in args.dtype:
                dtype = _DTYPES[dtype_name]
                cpp = LlamaCpp(write_gguf(ckpt, Path(tmp) / f"{size}-{dtype_name}.gguf",
                                          dtype_name), dtype_name)
                engine = Engine(load_model(str(ckpt), dtype), block_size=16)
                hf = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
                hf.generation_config.eos_token_id = None
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    for batch in args.batch:
                        row = _cell(args, shape, dtype, threads, batch, roofs[threads],
                                    engine, cpp, hf, size in _REPORTED)
                        print(f"{size:>5} {dtype_name:>9} " + row[0], flush=True)
                        misses += [f"{size} {dtype_name} {threads}t b{batch}: {m}"
                                   for m in row[1]]
    print("goals (opmux > transformers in every cell; at 100m opmux >= llama.cpp, batch 1 >= "
          "85 % of the bandwidth roofline, batch 16 >= 50 % of the GEMM roofline): "
          + ("all met" if not misses else "MISSED in " + "; ".join(misses)))


def _cell(args: argparse.Namespace, shape: LlamaShape, dtype: torch.dtype, threads: int,
          batch: int, roof: tuple[float, float], engine: Engine, cpp: LlamaCpp, hf: Any,
          reported: bool) -> tuple[str, list[str]]:
    """One table row (threads onwards) and the goals it misses (``reported``: only the lead
    over ``transformers`` is a goal)."""
    prompts = token_prompts(batch, args.prompt_len, shape.vocab)
    n = args.new_tokens
    clock = time.thread_time if args.clock == "thread" else time.perf_counter

    def run_opmux() -> tuple[list[list[int]], list[float]]:
        stamps: list[float] = []
        out = engine.generate(prompts, n, progress=lambda _: stamps.append(clock()))
        return out.outputs, stamps

    runs: dict[str, Callable[[], tuple[list[list[int]], list[float]]]] = {
        "opmux": run_opmux, "llama.cpp": lambda: cpp.generate(prompts, n, threads, clock),
        "transformers": lambda: _transformers(hf, prompts, n, clock)}
    rows = {name: fn()[0] for name, fn in runs.items()}  # warm-up, and the greedy tokens
    if dtype == torch.float32 and rows["opmux"] != rows["transformers"]:
        raise SystemExit("opmux and transformers disagree on the greedy float32 tokens")
    tps = dict.fromkeys(runs, 0.0)
    order = list(runs.items())
    for r in range(args.rounds):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            stamps = fn()[1]
            tps[name] = max(tps[name], batch * (len(stamps) - 1) / (stamps[-1] - stamps[0]))
    gbps, gflops = roof
    weights = _step_weights(shape)
    if batch == 1:
        ceiling, need = gbps * 1e9 / (weights * torch.empty(0, dtype=dtype).element_size()), 0.85
    else:
        ceiling, need = gflops * 1e9 / (2 * weights), 0.5
    same = (f"{sum(a == b for a, b in zip(rows['llama.cpp'], rows['opmux'], strict=True))}/"
            f"{batch} llama.cpp rows = opmux" if dtype == torch.float32 else "-")
    misses = []
    if tps["opmux"] < tps["llama.cpp"] and not reported:
        misses.append(f"{tps['opmux'] / tps['llama.cpp']:.2f}x llama.cpp")
    if tps["opmux"] <= tps["transformers"]:
        misses.append(f"{tps['opmux'] / tps['transformers']:.2f}x transformers")
    if tps["opmux"] < need * ceiling and not reported:
        misses.append(f"{100 * tps['opmux'] / ceiling:.0f} % of roofline")
    text = (f"{threads:>3} {batch:>5} {tps['opmux']:>8.1f} {tps['llama.cpp']:>9.1f} "
            f"{tps['transformers']:>12.1f} {tps['opmux'] / tps['llama.cpp']:>9.2f}x "
            f"{tps['opmux'] / tps['transformers']:>7.2f}x {ceiling:>8.1f} "
            f"{100 * tps['opmux'] / ceiling:>6.0f}% {100 * tps['llama.cpp'] / ceiling:>6.0f}%"
            f"  {same}")
    return text, misses


if __name__ == "__main__":
    main()
