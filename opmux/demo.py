"""``opmux demo``: a tiny Llama-style decoder served entirely by opmux ops.

Seeded random weights, a paged KV cache, prefill of prompts of different lengths, then N
greedy decode steps. Every op that a serving engine would take from a kernel library
(``rms_norm``, ``fused_add_rms_norm``, ``rotary_embedding``, ``reshape_and_cache``,
``paged_attention``, ``silu_and_mul``, ``advance_step_flashattn``) goes through opmux, so
the selected providers of the platform run. The same token stream is then scored with
every op forced to ``native``; the logits must agree within tolerance, and the two runs'
throughput is compared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Final, TextIO

import torch

if TYPE_CHECKING:
    from opmux.core.op import Op

__all__ = ["DemoConfig", "TinyLlama", "add_arguments", "generate", "run"]

DEMO_OPS: Final = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "reshape_and_cache",
                   "paged_attention", "silu_and_mul", "advance_step_flashattn")
"""The catalog ops the demo model calls."""

LOGIT_TOLERANCE: Final = {torch.float32: 2e-3, torch.bfloat16: 0.25, torch.float16: 5e-2}
"""Max abs logit difference allowed between the selected providers and native."""

_DTYPES: Final = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class DemoConfig:
    """Model and run sizes."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    head_size: int = 32
    intermediate: int = 512
    block_size: int = 16
    vocab: int = 1000
    batch: int = 4
    steps: int = 32
    min_prompt: int = 5
    max_prompt: int = 24
    seed: int = 0
    dtype: str = "fp32"

    def prompt_lens(self) -> list[int]:
        """Different prompt lengths per sequence, deterministic."""
        span = max(self.max_prompt - self.min_prompt + 1, 1)
        return [self.min_prompt + (7 * i + 11) % span for i in range(self.batch)]


class TinyLlama:
    """A Llama-style decoder: RMSNorm, rotary GQA attention over a paged cache, SwiGLU MLP.

    :param cfg: sizes.
    :param device: where weights and caches live.
    """

    def __init__(self, cfg: DemoConfig, device: torch.device) -> None:
        import opmux.ops as ops
        from opmux.ops.rotary import make_cos_sin_cache

        self.cfg = cfg
        self.device = device
        self.dtype = _DTYPES[cfg.dtype]
        self.ops: dict[str, Op] = {name: getattr(ops, name) for name in DEMO_OPS}
        g = torch.Generator().manual_seed(cfg.seed)
        h, d = cfg.hidden, cfg.head_size
        qkv = (cfg.heads + 2 * cfg.kv_heads) * d

        def w(*shape: int, std: float) -> torch.Tensor:
            return (torch.randn(shape, generator=g) * std).to(self.dtype).to(device)

        def norm_w(n: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(n, generator=g)).to(self.dtype).to(device)

        self.embed = w(cfg.vocab, h, std=1.0)
        self.layers = [{
            "in_norm": norm_w(h), "qkv": w(qkv, h, std=h ** -0.5),
            "o": w(h, cfg.heads * d, std=(cfg.heads * d) ** -0.5), "post_norm": norm_w(h),
            "gate_up": w(2 * cfg.intermediate, h, std=h ** -0.5),
            "down": w(h, cfg.intermediate, std=cfg.intermediate ** -0.5),
        } for _ in range(cfg.layers)]
        self.final_norm = norm_w(h)
        self.lm_head = w(cfg.vocab, h, std=h ** -0.5)
        self.max_positions = cfg.max_prompt + cfg.steps + 1
        self.cos_sin = make_cos_sin_cache(self.max_positions, d, dtype=self.dtype,
                                          device=device)

    def new_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed ``(key_cache, value_cache)`` per layer."""
        shape = (num_blocks, self.cfg.block_size, self.cfg.kv_heads, self.cfg.head_size)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(self.cfg.layers)]

    def _call(self, name: str, record: dict[str, str] | None, *args: Any) -> Any:
        op = self.ops[name]
        if record is not None and name not in record:
            record[name] = op.dispatch(*args).provider
        return op(*args)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]], block_tables: torch.Tensor,
                seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                record: dict[str, str] | None = None) -> torch.Tensor:
        """Logits ``[S, vocab]`` of the last query row of every sequence."""
        cfg = self.cfg
        t, d = tokens.shape[0], cfg.head_size
        nq, nkv = cfg.heads * d, cfg.kv_heads * d
        hidden = self.embed.index_select(0, tokens)
        residual: torch.Tensor | None = None
        for li, layer in enumerate(self.layers):
            if residual is None:
                residual = hidden
                x = self._call("rms_norm", record, hidden, layer["in_norm"], 1e-6)
            else:
                x, residual = self._call("fused_add_rms_norm", record, hidden, residual,
                                         layer["in_norm"], 1e-6)
            qkv = torch.nn.functional.linear(x, layer["qkv"])
            q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
            q, k = self._call("rotary_embedding", record, positions, q, k, self.cos_sin, d,
                              True)
            key_cache, value_cache = cache[li]
            self._call("reshape_and_cache", record, k.view(t, cfg.kv_heads, d),
                       v.view(t, cfg.kv_heads, d), key_cache, value_cache, slots)
            attn = self._call("paged_attention", record, q.view(t, cfg.heads, d), key_cache,
                              value_cache, block_tables, seq_lens, query_start_loc, d ** -0.5,
                              None, None)
            hidden = torch.nn.functional.linear(attn.view(t, nq), layer["o"])
            x, residual = self._call("fused_add_rms_norm", record, hidden, residual,
                                     layer["post_norm"], 1e-6)
            act = self._call("silu_and_mul", record,
                             torch.nn.functional.linear(x, layer["gate_up"]))
            hidden = torch.nn.functional.linear(act, layer["down"])
        assert residual is not None
        x, _ = self._call("fused_add_rms_norm", record, hidden, residual, self.final_norm, 1e-6)
        last = (query_start_loc[1:] - 1).long()
        return torch.nn.functional.linear(x.index_select(0, last), self.lm_head).float()


@dataclass
class GenerationResult:
    """Tokens, per-step logits, timings and the providers that served each op."""

    tokens: torch.Tensor          # [S, steps + 1] (first from prefill)
    logits: list[torch.Tensor]    # steps + 1 tensors [S, vocab] (CPU, fp32)
    prefill_s: float
    decode_s: float
    providers: dict[str, dict[str, str]]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(model: TinyLlama, prompts: list[torch.Tensor], steps: int, *,
             forced: torch.Tensor | None = None, progress: _Progress | None = None
             ) -> GenerationResult:
    """Prefill ``prompts`` and decode ``steps`` tokens greedily (or follow ``forced``).

    :param forced: ``[S, steps + 1]`` tokens to feed instead of the argmax (scoring mode).
    """
    cfg, dev = model.cfg, model.device
    adv = model.ops["advance_step_flashattn"]
    s, bs = len(prompts), cfg.block_size
    lens = [int(p.numel()) for p in prompts]
    per_seq = [(n + steps + bs) // bs for n in lens]
    num_blocks = sum(per_seq)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(cfg.seed + 1))
    tables = torch.zeros(s, max(per_seq), dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[start:start + n].to(torch.int32)
        start += n
    block_tables = tables.to(dev)
    cache = model.new_cache(num_blocks)
    positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
    blocks = torch.cat([tables[i, torch.arange(n) // bs].long() for i, n in enumerate(lens)])
    slots = (blocks * bs + torch.cat([torch.arange(n) % bs for n in lens])).to(dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                       device=dev)
    providers: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
    out_tokens, out_logits = [], []
    _sync(dev)
    t0 = time.perf_counter()
    logits = model.forward(torch.cat(prompts).to(dev), positions, slots, cache, block_tables,
                           seq_lens, qsl, providers["prefill"])
    _sync(dev)
    t1 = time.perf_counter()
    decode_qsl = torch.arange(s + 1, dtype=torch.int32, device=dev)
    tokens = torch.zeros(s, dtype=torch.int64, device=dev)
    pos = torch.zeros(s, dtype=torch.int64, device=dev)
    slot = torch.zeros(s, dtype=torch.int64, device=dev)
    for step in range(steps + 1):
        sampled = (forced[:, step].to(dev) if forced is not None
                   else logits.argmax(dim=-1)).view(s, 1)
        out_tokens.append(sampled.view(s))
        out_logits.append(logits)
        if step == steps:
            break
        record = providers["decode"] if step == 0 else None
        if record is not None:
            record["advance_step_flashattn"] = adv.dispatch(
                s, s, bs, tokens, sampled, pos, seq_lens, slot, block_tables).provider
        adv(s, s, bs, tokens, sampled, pos, seq_lens, slot, block_tables)
        logits = model.forward(tokens, pos, slot, cache, block_tables, seq_lens, decode_qsl,
                               record)
        if progress is not None:
            progress.update(step + 1)
    _sync(dev)
    t2 = time.perf_counter()
    return GenerationResult(torch.stack(out_tokens, dim=1).cpu(), [x.cpu() for x in out_logits],
                            t1 - t0, t2 - t1, providers)


class _Progress:
    """A one-line progress bar on stderr (TTY), or sparse lines for long runs."""

    def __init__(self, label: str, total: int, stream: TextIO, *, tty: bool) -> None:
        self.label, self.total, self.stream, self.tty = label, max(total, 1), stream, tty
        self.last = -1

    def update(self, done: int) -> None:
        frac = done / self.total
        if self.tty:
            bar = "#" * int(30 * frac)
            self.stream.write(f"\r  {self.label:<9} [{bar:<30}] {done}/{self.total}")
            if done >= self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif int(frac * 10) > self.last:
            self.last = int(frac * 10)
            self.stream.write(f"  {self.label}: {done}/{self.total} decode steps\n")
            self.stream.flush()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``demo`` options to ``parser``."""
    d = DemoConfig()
    parser.add_argument("--layers", type=int, default=d.layers, help="decoder layers")
    parser.add_argument("--steps", type=int, default=d.steps, help="decode steps")
    parser.add_argument("--batch", type=int, default=d.batch, help="sequences")
    parser.add_argument("--hidden", type=int, default=d.hidden,
                        help="hidden size (head size = hidden / heads)")
    parser.add_argument("--heads", type=int, default=d.heads, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=d.kv_heads, help="key/value heads")
    parser.add_argument("--block-size", type=int, default=d.block_size, help="KV block size")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=d.dtype)
    parser.add_argument("--device", default=None,
                        help="torch device (default: the detected platform's device)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads during the run (default 1: the model is tiny, "
                             "and OpenMP synchronisation costs more than it gains)")
    parser.add_argument("--json", action="store_true", help="print a JSON report")


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        from opmux.platforms import current_platform

        name = current_platform().device_type
    if name == "xla":
        import torch_xla

        return torch.device(torch_xla.device())
    return torch.device(name)


def _config(ns: argparse.Namespace) -> DemoConfig:
    from opmux.core.errors import ConfigError

    if ns.heads <= 0 or ns.hidden % ns.heads or ns.kv_heads <= 0 or ns.heads % ns.kv_heads:
        raise ConfigError(f"opmux demo: --hidden ({ns.hidden}) must be a multiple of --heads "
                          f"({ns.heads}), and --heads of --kv-heads ({ns.kv_heads})")
    for name in ("layers", "batch", "block_size"):
        if getattr(ns, name) <= 0:
            raise ConfigError(f"opmux demo: --{name.replace('_', '-')} must be positive, got "
                              f"{getattr(ns, name)}")
    if ns.steps < 0:
        raise ConfigError(f"opmux demo: --steps must be >= 0, got {ns.steps}")
    head = ns.hidden // ns.heads
    if head % 2:
        raise ConfigError(f"opmux demo: the head size hidden/heads = {head} must be even")
    return DemoConfig(layers=ns.layers, hidden=ns.hidden, heads=ns.heads, kv_heads=ns.kv_heads,
                      head_size=head, intermediate=2 * ns.hidden, block_size=ns.block_size,
                      batch=ns.batch, steps=ns.steps, seed=ns.seed, dtype=ns.dtype)


def run(ns: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the demo; returns 0 when the logits match native within tolerance, else 1.

    :param ns: parsed options (see :func:`add_arguments`).
    :param out: where the report goes (default stdout).
    :param err: where progress and errors go (default stderr).
    """
    threads = getattr(ns, "threads", None)
    previous = torch.get_num_threads()
    if threads is not None and threads > 0:
        torch.set_num_threads(threads)
    try:
        return _run(ns, out or sys.stdout, err or sys.stderr)
    finally:
        torch.set_num_threads(previous)


def _run(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import opmux

    try:
        cfg = _config(ns)
    except opmux.ConfigError as exc:
        print(str(exc), file=err)
        return 2
    device = _resolve_device(ns.device)
    opmux.load_plugins()
    model = TinyLlama(cfg, device)
    g = torch.Generator().manual_seed(cfg.seed + 2)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in cfg.prompt_lens()]

    def as_native() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for op in model.ops.values():
            stack.enter_context(op.set_priority(["native"]))
        return stack

    # warm up both paths (plugin kernels load lazily), then time them
    generate(model, prompts, min(cfg.steps, 1))
    with as_native():
        generate(model, prompts, min(cfg.steps, 1))
    show = not ns.json and (err.isatty() or cfg.steps * cfg.layers >= 2000)
    tty = err.isatty()
    selected = generate(model, prompts, cfg.steps,
                        progress=_Progress("selected", cfg.steps, err, tty=tty) if show else None)
    with as_native():
        native = generate(model, prompts, cfg.steps, forced=selected.tokens,
                          progress=_Progress("native", cfg.steps, err, tty=tty) if show
                          else None)
    diff = max(float((a - b).abs().max()) if a.numel() else 0.0
               for a, b in zip(selected.logits, native.logits, strict=True))
    tol = LOGIT_TOLERANCE[model.dtype]
    agree = int(sum(int((n.argmax(-1) == s_tok).sum()) for n, s_tok in
                    zip(native.logits, selected.tokens.unbind(1), strict=True)))
    generated = cfg.batch * (cfg.steps + 1)

    def rate(r: GenerationResult) -> float:
        return generated / max(r.prefill_s + r.decode_s, 1e-9)

    ok = diff <= tol
    report: dict[str, Any] = {
        "ok": ok, "device": str(device), "platform": opmux.current_platform().name,
        "threads": torch.get_num_threads(), "config": asdict(cfg), "prompt_lens": cfg.prompt_lens(),
        "providers": selected.providers, "max_abs_diff": diff, "tolerance": tol,
        "tokens_agree": agree, "tokens_total": generated,
        "tokens_per_s": {"native": rate(native), "selected": rate(selected)},
        "decode_tokens_per_s": {
            "native": cfg.batch * cfg.steps / max(native.decode_s, 1e-9),
            "selected": cfg.batch * cfg.steps / max(selected.decode_s, 1e-9)},
        "speedup": rate(selected) / max(rate(native), 1e-9),
        "tokens": selected.tokens.tolist(),
    }
    if ns.json:
        print(json.dumps(report, indent=2), file=out)
        return 0 if ok else 1
    print(f"opmux demo: Llama-style decoder, {cfg.layers} layers, hidden {cfg.hidden}, "
          f"{cfg.heads}/{cfg.kv_heads} heads x {cfg.head_size}, block {cfg.block_size}, "
          f"vocab {cfg.vocab}, {cfg.dtype}", file=out)
    print(f"device {device} (platform {report['platform']}, torch threads "
          f"{report['threads']}), batch {cfg.batch}, prompt lengths {cfg.prompt_lens()}, "
          f"{cfg.steps} decode steps\n", file=out)
    width = max(len(n) for n in DEMO_OPS)
    print(f"  {'op':<{width}}  {'prefill':<12}  decode", file=out)
    for name in DEMO_OPS:
        print(f"  {name:<{width}}  {selected.providers['prefill'].get(name, '-'):<12}  "
              f"{selected.providers['decode'].get(name, '-')}", file=out)
    verdict = "OK" if ok else "MISMATCH"
    print(f"\nlogits vs all-native: max abs diff {diff:.3g} (tolerance {tol:g}) {verdict}; "
          f"native argmax agrees on {agree}/{generated} tokens", file=out)
    print(f"throughput: native {rate(native):.1f} tokens/s, selected {rate(selected):.1f} "
          f"tokens/s ({report['speedup']:.2f}x); decode only: native "
          f"{report['decode_tokens_per_s']['native']:.1f}, selected "
          f"{report['decode_tokens_per_s']['selected']:.1f} tokens/s", file=out)
    if not ok:
        print("opmux demo: the selected providers' logits differ from native beyond "
              "tolerance; run `opmux check` to find the provider", file=err)
    return 0 if ok else 1
