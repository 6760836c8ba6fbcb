"""One decoder for the four architectures, built from opmux layers and catalog ops.

Llama, Qwen2 (QKV bias), Mixtral (``FusedMoE`` instead of the MLP) and Gemma2 (gemma
norms, sandwich norms around attention and MLP, GELU-tanh, soft caps, alternating sliding
window, ``query_pre_attn_scalar``, embeddings scaled by ``sqrt(hidden)``) differ only in
flags of :class:`~opmux.models.config.ModelConfig`. Linear layers, embedding, LM head and
MoE are tensor-parallel (``opmux.distributed``'s group); attention runs on a paged KV
cache through ``reshape_and_cache`` and ``paged_attention``; norms are ``RMSNorm`` and
``GemmaRMSNorm`` (``x * (1 + w)``), the residual add fused into the next norm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

import opmux.ops as ops
from opmux.core.registry import global_registry
from opmux.core.tally import counting
from opmux.distributed import get_tensor_model_parallel_world_size
from opmux.layers import (
    GeluAndMul,
    GemmaRMSNorm,
    LogitsProcessor,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    get_rope,
)
from opmux.layers.moe import FusedMoE
from opmux.models._packed import _ROW_KERNEL_ROWS, PackedWeight, can_pack, place_row_weights
from opmux.models.config import ModelConfig
from opmux.models.memory import MemoryNeed, check_fits
from opmux.ops.kv_formats import KVCacheFormat, get_kv_cache_format, kv_cache_format

__all__ = ["AttentionBatch", "CausalLM", "WeightTarget"]

_CPP = "cpp"  # the CPU plugin's provider, whose kernels the one-call layer runs


@dataclass
class AttentionBatch:
    """The paged-attention metadata of one step (shared by all layers).

    :ivar slots: ``[T]`` int64 cache slot of each token.
    :ivar block_tables: ``[S, max_blocks]`` int32.
    :ivar seq_lens: ``[S]`` int32, cached tokens per sequence including this step's.
    :ivar query_start_loc: ``[S + 1]`` int32 ragged offsets of the query rows.
    :ivar kv_cache_format: the registered KV-cache format the caches were allocated in
        (:meth:`CausalLM.new_kv_cache`).
    """

    slots: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    kv_cache_format: str = "canonical"


WeightTarget = tuple[tuple[int, ...], Callable[[Tensor], None]]
"""``(full shape on disk, loader)`` of one checkpoint tensor."""


def _norm(cfg: ModelConfig, dtype: torch.dtype) -> RMSNorm | GemmaRMSNorm:
    if cfg.gemma:  # weight kept in fp32 (the norm computes 1 + w in fp32)
        return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


_PACKED = "packed_weight"  # the attribute :meth:`CausalLM.pack_weights` sets on a layer


def _project(layer: torch.nn.Module, x: Tensor) -> Tensor:
    """``layer(x)``, through the layer's packed weight where it has one that takes ``x``."""
    packed: PackedWeight | None = getattr(layer, _PACKED, None)
    if packed is not None and packed.takes(x):
        return packed(x)
    out: Tensor = layer(x)
    return out


def _loader(param: Tensor) -> Callable[[Tensor], None]:
    def load(t: Tensor) -> None:
        with torch.no_grad():
            param.copy_(t)

    return load


class _Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.qkv_bias, params_dtype=dtype,
                                          return_bias=False)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=False,
                                        params_dtype=dtype, return_bias=False)
        self.rotary = get_rope(d, cfg.max_position, True, cfg.rope_parameters, dtype)
        self.heads, self.kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.scale = cfg.attn_scale
        self.window = cfg.sliding_windows[layer]
        self.soft_cap = cfg.attn_soft_cap
        self.qkv_sizes = [self.heads * d, self.kv_heads * d, self.kv_heads * d]

    def forward(self, x: Tensor, positions: Tensor, cache: tuple[Tensor, Tensor],
                meta: AttentionBatch) -> Tensor:
        q, k, v = _project(self.qkv_proj, x).split(self.qkv_sizes, dim=-1)
        q, k = self.rotary(positions, q, k)
        return _project(self.o_proj, self.attend(q, k, v, cache, meta))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: tuple[Tensor, Tensor],
               meta: AttentionBatch) -> Tensor:
        """The step's keys and values written to ``cache``, then paged attention of the
        rotated queries: ``[T, heads * head_dim]``."""
        t, d = q.shape[0], self.head_dim
        ops.reshape_and_cache(k.reshape(t, self.kv_heads, d), v.reshape(t, self.kv_heads, d),
                              cache[0], cache[1], meta.slots, meta.kv_cache_format)
        attn: Tensor = ops.paged_attention(q.reshape(t, self.heads, d), cache[0], cache[1],
                                           meta.block_tables, meta.seq_lens,
                                           meta.query_start_loc, self.scale, self.window,
                                           self.soft_cap, meta.kv_cache_format)
        return attn.view(t, self.heads * d)


class _MLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter],
                                                       bias=False, params_dtype=dtype,
                                                       return_bias=False)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=False,
                                           params_dtype=dtype, return_bias=False)
        self.act = GeluAndMul("tanh") if cfg.gemma else SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:
        return _project(self.down_proj, self.act(_project(self.gate_up_proj, x)))


class _MoE(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.experts = FusedMoE(cfg.num_experts, cfg.experts_per_token, cfg.hidden_size,
                                cfg.intermediate_size, layer_name=f"model.layers.{layer}.moe",
                                renormalize=True, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        _, fused = self.experts(x)
        out: Tensor = fused
        return out


class _Layer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        g = cfg.gemma
        self.self_attn = _Attention(cfg, layer, dtype)
        self.mlp: torch.nn.Module = _MoE(cfg, layer, dtype) if cfg.num_experts else _MLP(cfg,
                                                                                        dtype)
        self.input_layernorm = _norm(cfg, dtype)
        self.post_attention_layernorm = _norm(cfg, dtype)
        self.pre_feedforward_layernorm = _norm(cfg, dtype) if g else None
        self.post_feedforward_layernorm = _norm(cfg, dtype) if g else None

    def forward(self, hidden: Tensor, residual: Tensor | None, positions: Tensor,
                cache: tuple[Tensor, Tensor], meta: AttentionBatch) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual = hidden
            x = self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        x = self.self_attn(x, positions, cache, meta)
        if self.pre_feedforward_layernorm is not None:  # gemma's sandwich norms
            x = self.post_attention_layernorm(x)
            x, residual = self.pre_feedforward_layernorm(x, residual)
        else:
            x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.post_feedforward_layernorm is not None:
            x = self.post_feedforward_layernorm(x)
        return x, residual


class _LeanLayer:
    """A :class:`_Layer`'s step without module calls: its two norms, rotary embedding and
    activation as direct calls of the catalog ops their layers would call, its four
    projections through their packed weights. Same result as the layer
    (``tests/models/test_engine.py``).

    :meth:`CausalLM.pack_weights` builds one per layer where every part of the layer would
    take that path anyway (:func:`_lean_layer`), and the model's forward runs it outside
    autograd and compilation. A decode step's Python runs on caches that the weight stream
    has just flushed, so each frame saved counts several times over
    (``benchmarks/decode_profile.py``, "without the lean layers").

    :meth:`fused` runs the same kernels in one call of the CPU plugin's ``decoder_layer``
    (``csrc/cpu/decoder_layer.cpp``), for the steps where every op it stands for would take
    the ``cpp`` provider anyway (:func:`_kernel_ops_first`) and its projections the row
    kernel (``benchmarks/decode_profile.py``, "op calls, not one call per layer").
    """

    def __init__(self, layer: _Layer, packs: list[PackedWeight]) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, _MLP)
        # the norms' parameter tables and the rotary layer, read at each call as the layers
        # read them
        self.norm1 = layer.input_layernorm._parameters
        self.norm2 = layer.post_attention_layernorm._parameters
        self.eps1 = layer.input_layernorm.variance_epsilon
        self.eps2 = layer.post_attention_layernorm.variance_epsilon
        self.attn, self.rotary = attn, attn.rotary
        self.head_size, self.neox = attn.rotary.head_size, attn.rotary.is_neox_style
        self.qkv, self.o, self.gate_up, self.down = packs
        #: the one-call layer (:meth:`fused`) where this layer's weights allow it, else None
        self.kernel = _layer_kernel() if _kernel_takes(attn, packs) else None

    def fused(self, hidden: Tensor, residual: Tensor | None, positions: Tensor,
              cache: tuple[Tensor, Tensor], meta: AttentionBatch) -> tuple[Tensor, Tensor]:
        """:meth:`__call__` in one kernel call (same kernels, same order, same result); a
        step whose arguments a kernel refuses (or that has a tensor off the CPU) runs
        :meth:`__call__`, whose ops say what is wrong or hand the call to the next
        provider."""
        kernel, attn = self.kernel, self.attn
        assert kernel is not None
        cos_sin = self.rotary.cos_sin_cache
        if cos_sin.dtype != hidden.dtype:  # as the layer does: the cache in the query's dtype
            cos_sin = cos_sin.to(hidden.dtype)
        window, cap = attn.window, attn.soft_cap
        try:
            out: tuple[Tensor, Tensor] = kernel(
                hidden, residual, self.norm1["weight"], self.eps1, self.norm2["weight"],
                self.eps2, self.qkv.rows(), self.qkv.bias, self.o.rows(), self.gate_up.rows(),
                self.down.rows(), self.qkv._place is not None, positions, cos_sin, attn.heads,
                attn.kv_heads, attn.head_dim, self.neox, cache[0], cache[1], meta.slots,
                meta.block_tables, meta.seq_lens, meta.query_start_loc, attn.scale,
                -1 if window is None else window, 0.0 if cap is None else cap)
        except (ValueError, NotImplementedError):  # refused, or a tensor on another device
            return self(hidden, residual, positions, cache, meta)
        return out

    def __call__(self, hidden: Tensor, residual: Tensor | None, positions: Tensor,
                 cache: tuple[Tensor, Tensor], meta: AttentionBatch) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual = hidden
            x = ops.rms_norm(hidden, self.norm1["weight"], self.eps1)
        else:
            x, residual = ops.fused_add_rms_norm(hidden, residual, self.norm1["weight"],
                                                 self.eps1)
        q, k, v = self.qkv(x).split(self.attn.qkv_sizes, dim=-1)
        cos_sin = self.rotary.cos_sin_cache
        if cos_sin.dtype != q.dtype:  # as the layer does: the cache in the query's dtype
            cos_sin = cos_sin.to(q.dtype)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin, self.head_size, self.neox)
        x, residual = ops.fused_add_rms_norm(self.o(self.attn.attend(q, k, v, cache, meta)),
                                             residual, self.norm2["weight"], self.eps2)
        return self.down(ops.silu_and_mul(self.gate_up(x))), residual


def _layer_kernel() -> Callable[..., tuple[Tensor, Tensor]] | None:
    """The CPU plugin's one-call decoder layer where its kernels are loaded (start-up, run
    here if nothing ran it yet, loads them)."""
    global_registry().ensure_loaded()
    kernel: Callable[..., tuple[Tensor, Tensor]] | None = getattr(
        torch.ops.opmux_cpu, "decoder_layer", None)
    return kernel


def _kernel_takes(attn: _Attention, packs: list[PackedWeight]) -> bool:
    """Whether the one-call layer can stand for a layer with these projections: all four
    through the row kernel from one kind of memory, biases on QKV only (Qwen2), and the
    rotary embedding over the attention's heads."""
    placed = {p._place is not None for p in packs}
    return (all(p._row_kernel is not None for p in packs) and len(placed) == 1
            and all(p.bias is None for p in packs[1:])
            and attn.rotary.head_size == attn.head_dim)


def _kernel_ops_first() -> bool:
    """Whether every catalog op the one-call layer stands for tries the ``cpp`` provider
    first on the CPU, as registered, and no :class:`~opmux.ProviderTally` is counting (it
    counts op calls, so it gets them). Read once per step."""
    if counting():
        return False
    for op in (ops.rms_norm, ops.fused_add_rms_norm, ops.rotary_embedding,
               ops.reshape_and_cache, ops.paged_attention, ops.silu_and_mul):
        impl = op.first_choice("CPU")
        if impl is None or impl.provider != _CPP:
            return False
    return True


def _takes_op_path(layer: torch.nn.Module, op_path: Callable[..., Any]) -> bool:
    """Whether ``layer``, an in-tree layer of its exact class, chose ``op_path`` (its catalog
    op) as its forward: not disabled (``forward_native``), not replaced out of tree."""
    return bool(layer.forward == op_path)


def _lean_layer(layer: _Layer) -> _LeanLayer | None:
    """The layer's :class:`_LeanLayer`, or ``None`` where some part of it would not take
    the lean layer's path: Gemma's norms, MoE, a disabled or replaced layer, a rotary
    embedding with its own forward, or a projection without a packed weight."""
    attn, mlp = layer.self_attn, layer.mlp
    if layer.pre_feedforward_layernorm is not None or not isinstance(mlp, _MLP):
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    rotary, act = attn.rotary, mlp.act
    if not (all(type(n) is RMSNorm and n.variance_size_override is None
                and _takes_op_path(n, n.forward_cpu) for n in norms)
            and isinstance(rotary, RotaryEmbedding)
            and type(rotary).forward_op is RotaryEmbedding.forward_op
            and _takes_op_path(rotary, rotary.forward_op)
            and type(act) is SiluAndMul and _takes_op_path(act, act.forward_op)):
        return None
    packs = [getattr(m, _PACKED, None)
             for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(p is None for p in packs):
        return None
    return _LeanLayer(layer, [p for p in packs if p is not None])


class CausalLM(torch.nn.Module):
    """A decoder-only causal LM of one of :data:`~opmux.models.config.ARCHITECTURES`.

    Built empty (parameters uninitialised); :func:`opmux.models.load_model` fills it.

    :param cfg: the checked configuration.
    :param dtype: parameter and activation dtype.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                   params_dtype=dtype)
        layers = [_Layer(cfg, i, dtype) for i in range(cfg.num_layers)]
        self.layers = torch.nn.ModuleList(layers)
        self.norm = _norm(cfg, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, params_dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_weights(self.embed_tokens)
        self.logits_processor = LogitsProcessor(cfg.vocab_size, soft_cap=cfg.final_soft_cap)
        self.num_kv_heads: int = layers[0].self_attn.kv_heads if layers else 0
        self.tp_size = get_tensor_model_parallel_world_size()
        #: every layer's :class:`_LeanLayer`, where :meth:`pack_weights` could build them all
        self._lean: list[_LeanLayer] | None = None

    def moe_layers(self) -> dict[str, FusedMoE]:
        """The MoE layers by ``layer_name`` (the forward context the engine sets)."""
        return {m.layer_name: m for m in self.modules() if isinstance(m, FusedMoE)}

    def kv_cache_format(self, block_size: int, device: torch.device | None = None
                        ) -> KVCacheFormat:
        """The KV-cache format to allocate on ``device``: the one the winning
        ``paged_attention`` provider prefers (:func:`opmux.kv_cache_format`)."""
        dev = torch.device("cpu") if device is None else torch.device(device)
        return kv_cache_format(dev, self.dtype, self.config.head_dim, self.num_kv_heads,
                               block_size)

    def new_kv_cache(self, num_blocks: int, block_size: int,
                     device: torch.device | None = None,
                     kv_cache_format: str = "canonical") -> list[tuple[Tensor, Tensor]]:
        """Zeroed ``(key_cache, value_cache)`` per layer, this rank's KV heads, in the
        registered format ``kv_cache_format`` (pass the same name in
        :attr:`AttentionBatch.kv_cache_format`)."""
        fmt = get_kv_cache_format(kv_cache_format)
        return [fmt.allocate(num_blocks, block_size, self.num_kv_heads, self.config.head_dim,
                             self.dtype, device)
                for _ in range(self.config.num_layers)]

    def forward(self, tokens: Tensor, positions: Tensor, kv_cache: list[tuple[Tensor, Tensor]],
                meta: AttentionBatch) -> Tensor:
        """Float32 logits ``[S, vocab]`` of the last query row of each sequence."""
        hidden = self.embed_tokens(tokens)
        if self.config.gemma:
            hidden = hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)
        residual: Tensor | None = None
        lean = self._lean
        if lean is not None and (torch.is_grad_enabled() or torch.compiler.is_compiling()
                                 or not hidden.is_cpu or hidden.dtype != self.dtype
                                 or hidden.dim() != 2 or hidden.shape[0] == 0):
            lean = None  # the packed weights' conditions (PackedWeight.takes)
        fused = (lean is not None and all(step.kernel is not None for step in lean)
                 and hidden.shape[0] <= _ROW_KERNEL_ROWS
                 and meta.kv_cache_format == "canonical" and _kernel_ops_first())
        for i, (layer, cache) in enumerate(zip(self.layers, kv_cache, strict=True)):
            step = layer if lean is None else lean[i].fused if fused else lean[i]
            hidden, residual = step(hidden, residual, positions, cache, meta)
        if residual is None:
            x = self.norm(hidden)
        else:
            x, _ = self.norm(hidden, residual)
        last = (meta.query_start_loc[1:] - 1).long()
        x = x.index_select(0, last)
        head: PackedWeight | None = getattr(self.lm_head, _PACKED, None)
        if head is not None and head.takes(x):
            logits: Tensor = head(x)[:, :self.config.vocab_size]  # no soft cap (pack_weights)
        else:
            logits = self.logits_processor(self.lm_head, x)
        return logits.float()

    def pack_weights(self, enable: bool = True) -> int:
        """Give every CPU linear layer and the LM head copies of its weight laid out for the
        GEMM libraries (:mod:`opmux.models._packed`: float32, and bfloat16 on CPUs with native
        bfloat16 compute), called instead of the layer; single-rank
        models only (a tensor-parallel layer keeps its own path), and the LM head only
        without a final soft cap. What the row kernel streams (bfloat16 copies; float32
        weights themselves, their data moved: same parameters, same values) goes onto one
        region of huge pages (:func:`~opmux.models._packed.place_row_weights`). Where every
        decoder layer's parts take their catalog ops, it also gives each layer a lean step
        (:class:`_LeanLayer`) that the forward runs outside autograd and compilation.
        ``enable=False`` drops the copies and the lean steps.
        Returns the bytes the copies take (made at first use; a layer already packed keeps
        its copy).

        :raises opmux.models.MemoryBudgetError: the copies do not fit the memory available
            (checked before any layer is given one).
        """
        layers: list[torch.nn.Module] = [self.lm_head] if self.config.final_soft_cap is None \
            else []
        for layer in self.layers:
            assert isinstance(layer, _Layer)
            attn, mlp = layer.self_attn, layer.mlp
            layers += [attn.qkv_proj, attn.o_proj]
            if isinstance(mlp, _MLP):
                layers += [mlp.gate_up_proj, mlp.down_proj]
        self._lean = None
        if not enable or self.tp_size != 1:
            for mod in layers:
                mod.__dict__.pop(_PACKED, None)
            return 0
        packs: list[tuple[torch.nn.Module, PackedWeight]] = []
        for mod in layers:
            weight = mod.weight
            bias = None if mod is self.lm_head else getattr(mod, "bias", None)
            if isinstance(weight, Tensor) and can_pack(weight, bias):
                old: PackedWeight | None = getattr(mod, _PACKED, None)
                if old is None or old.weight is not weight or old.bias is not bias:
                    old = PackedWeight(weight, bias)
                packs.append((mod, old))
        added = sum(p.copies_bytes() for _, p in packs)
        check_fits([MemoryNeed("packed weights", added, "copies of the linear weights laid "
                               "out for the GEMM libraries",
                               "build the Engine with pack_weights=False")],
                   "cpu", "pack_weights")
        for mod, packed in packs:
            setattr(mod, _PACKED, packed)
        place_row_weights(packed for _, packed in packs)
        lean = [_lean_layer(layer) for layer in self.layers
                if isinstance(layer, _Layer)]
        if lean and all(step is not None for step in lean):
            self._lean = [step for step in lean if step is not None]
        return added

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Every checkpoint tensor this model reads: name → (full shape, loader)."""
        cfg = self.config
        h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        out: dict[str, WeightTarget] = {}

        def put(name: str, shape: tuple[int, ...], fn: Callable[[Tensor], None]) -> None:
            out[name] = (shape, fn)

        emb = self.embed_tokens
        put("model.embed_tokens.weight", (cfg.vocab_size, h),
            partial(emb.weight_loader, emb.weight))
        if not cfg.tie_word_embeddings:
            head = self.lm_head
            put("lm_head.weight", (cfg.vocab_size, h), partial(head.weight_loader, head.weight))
        put("model.norm.weight", (h,), _loader(self.norm.weight))
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, _Layer)
            p = f"model.layers.{i}."
            for nm in ("input_layernorm", "post_attention_layernorm",
                       "pre_feedforward_layernorm", "post_feedforward_layernorm"):
                norm = getattr(layer, nm)
                if norm is not None:
                    put(f"{p}{nm}.weight", (h,), _loader(norm.weight))
            qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
            sizes = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d,
                     "v": cfg.num_kv_heads * d}
            for sid, rows in sizes.items():
                put(f"{p}self_attn.{sid}_proj.weight", (rows, h),
                    partial(qkv.weight_loader, qkv.weight, loaded_shard_id=sid))
                if qkv.bias is not None:
                    put(f"{p}self_attn.{sid}_proj.bias", (rows,),
                        partial(qkv.weight_loader, qkv.bias, loaded_shard_id=sid))
            put(f"{p}self_attn.o_proj.weight", (h, cfg.num_heads * d),
                partial(o.weight_loader, o.weight))
            mlp = layer.mlp
            if isinstance(mlp, _MoE):
                moe = mlp.experts
                q = f"{p}block_sparse_moe."
                put(f"{q}gate.weight", (cfg.num_experts, h),
                    partial(moe.weight_loader, moe.gate_weight))
                for e in range(cfg.num_experts):
                    for w, shape in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
                        param = moe.w2_weight if w == "w2" else moe.w13_weight
                        put(f"{q}experts.{e}.{w}.weight", shape,
                            partial(moe.weight_loader, param, shard_id=w, expert_id=e))
            else:
                assert isinstance(mlp, _MLP)
                gu, down = mlp.gate_up_proj, mlp.down_proj
                put(f"{p}mlp.gate_proj.weight", (inter, h),
                    partial(gu.weight_loader, gu.weight, loaded_shard_id=0))
                put(f"{p}mlp.up_proj.weight", (inter, h),
                    partial(gu.weight_loader, gu.weight, loaded_shard_id=1))
                put(f"{p}mlp.down_proj.weight", (h, inter),
                    partial(down.weight_loader, down.weight))
        return out
