"""Rotary layers: vLLM 0.32's rope rows of the CustomOp table, and :func:`get_rope`.

``RotaryEmbedding`` (registered as ``rotary_embedding`` through its base class, as vLLM does)
and the scaling variants Llama-3-family checkpoints need (``Llama3RotaryEmbedding``,
``LinearScalingRotaryEmbedding``, ``DynamicNTKScalingRotaryEmbedding``,
``YaRNScalingRotaryEmbedding``) differ only in their ``cos_sin_cache`` buffer; ``ApplyRotaryEmb``
(``apply_rotary_emb``) rotates whole heads by given ``cos``/``sin``;
``DualChunkRotaryEmbedding`` (``dual_chunk_rotary_embedding``) is Dual Chunk Attention's rope.
Class names, constructor arguments, buffer names and forward results are vLLM's.

``forward_native`` is plain PyTorch; the platform paths (``forward_cpu``, ``forward_cuda``,
``forward_xla``, ``forward_npu``) call catalog ops: ``opmux::rotary_embedding`` for the
``RotaryEmbedding`` family, ``opmux::apply_rotary_emb`` and
``opmux::dual_chunk_rotary_embedding`` for the other two. As in vLLM, the ``RotaryEmbedding``
platform path rotates ``query`` and ``key`` **in place** and returns them, while
``forward_native`` returns new tensors and leaves its inputs alone.

>>> import torch
>>> from opmux.layers import get_rope
>>> rope = get_rope(64, 2048, rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3",
...                 "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
...                 "original_max_position_embeddings": 8192}, dtype=torch.float32)
>>> type(rope).__name__, tuple(rope.cos_sin_cache.shape)
('Llama3RotaryEmbedding', (2048, 64))
>>> q, k = rope(torch.arange(3), torch.randn(3, 4 * 64), torch.randn(3, 64))
>>> tuple(q.shape), tuple(k.shape)
((3, 256), (3, 64))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from opmux.core.errors import ConfigError
from opmux.layers._rope import _RopeLayer
from opmux.layers.custom_op import CustomOp
from opmux.ops.rotary import (
    apply_rotary_emb,
    dual_chunk_rotary_embedding,
    make_dual_chunk_caches,
    rotary_embedding,
)

__all__ = [
    "ROPE_TYPES",
    "ApplyRotaryEmb",
    "DualChunkRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "RotaryEmbedding",
    "RotaryEmbeddingBase",
    "YaRNScalingRotaryEmbedding",
    "get_rope",
    "reset_rope_cache",
]


def _rotate_halves(x: Tensor, cos: Tensor, sin: Tensor, is_neox_style: bool) -> Tensor:
    """``x[..., 2h]`` rotated by ``cos``/``sin`` ``[..., h]`` broadcast over ``x``'s dims."""
    if is_neox_style:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


# --------------------------------------------------------------------------- ApplyRotaryEmb
@CustomOp.register("apply_rotary_emb")
class ApplyRotaryEmb(CustomOp):
    """Rotate whole heads by per-position ``cos``/``sin`` (vLLM's ``ApplyRotaryEmb``).

    ``forward(x, cos, sin)``: ``x`` is ``[batch (optional), seq_len, num_heads, head_size]``,
    ``cos``/``sin`` ``[seq_len, head_size // 2]``; returns a new tensor like ``x``. Math in
    ``x``'s dtype, or in float32 with ``enable_fp32_compute``.

    :param enforce_enable: take the platform path even when the enablement string disables
        ``apply_rotary_emb`` (vLLM's vision encoders build it so).
    :param is_neox_style: rotate halves (True) or interleaved pairs (GPT-J style).
    :param enable_fp32_compute: compute in float32 and cast back.
    """

    def __init__(self, enforce_enable: bool = False, is_neox_style: bool = True,
                 enable_fp32_compute: bool = False) -> None:
        #: platform path regardless of the enablement string (read in ``__init__``).
        self.enforce_enable = enforce_enable
        super().__init__()
        self.is_neox_style = is_neox_style
        self.enable_fp32_compute = enable_fp32_compute

    def dispatch_forward(self) -> Callable[..., Any]:
        """As :class:`CustomOp`, but ``enforce_enable`` keeps the op path when disabled."""
        method = super().dispatch_forward()
        if self.enforce_enable and method == self.forward_native:
            return self.forward_op
        return method

    @staticmethod
    def forward_static(x: Tensor, cos: Tensor, sin: Tensor, is_neox_style: bool = True,
                       enable_fp32_compute: bool = False) -> Tensor:
        """Plain PyTorch rotation (vLLM's ``ApplyRotaryEmb.forward_static``)."""
        dtype = x.dtype
        if enable_fp32_compute:
            x = x.float()
        out = _rotate_halves(x, cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype),
                             is_neox_style)
        return out.to(dtype)

    def forward_native(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self.forward_static(x, cos, sin, self.is_neox_style, self.enable_fp32_compute)

    def forward_op(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The platform path: the catalog op ``opmux::apply_rotary_emb``."""
        out: Tensor = apply_rotary_emb(x, cos, sin, self.is_neox_style,
                                       self.enable_fp32_compute)
        return out

    forward_cpu = forward_cuda = forward_xla = forward_npu = forward_op

    def extra_repr(self) -> str:
        return (f"is_neox_style={self.is_neox_style}, "
                f"enable_fp32_compute={self.enable_fp32_compute}")


# -------------------------------------------------------------------------- RotaryEmbedding
@CustomOp.register("rotary_embedding")
class RotaryEmbeddingBase(_RopeLayer):
    """Rotary positional embedding with a ``cos_sin_cache`` buffer (vLLM's base class).

    ``cos_sin_cache`` is ``[max_position_embeddings, rotary_dim]`` in ``dtype``: ``cos``
    columns first, then ``sin`` (not persistent: it is not in the state dict). Subclasses
    change the cache through :meth:`_compute_inv_freq` / :meth:`_compute_cos_sin_cache`.

    :param head_size: D.
    :param rotary_dim: how many leading dims of each head rotate (even, ``<= head_size``).
    :param max_position_embeddings: cache rows.
    :param base: frequency base (``rope_theta``).
    :param is_neox_style: rotate halves (True) or interleaved pairs (GPT-J style).
    :param dtype: the cache's dtype (it follows the query's at the first call).
    :param init_cache: build the cache now.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, dtype: torch.dtype,
                 init_cache: bool = True) -> None:
        super().__init__()
        self._init_rope(head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
                        dtype)
        self.cos_sin_cache: Tensor
        if init_cache:
            self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache().to(dtype),
                                 persistent=False)
        self.apply_rotary_emb = ApplyRotaryEmb(is_neox_style=self.is_neox_style)

    def _compute_inv_freq(self, base: float) -> Tensor:
        """``1 / base ** (2i / rotary_dim)`` for ``i < rotary_dim / 2`` (float32)."""
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim
        return 1.0 / (base ** exponents)

    def _compute_cos_sin_cache(self) -> Tensor:
        """``cat(cos, sin)`` of ``position * inv_freq`` for every position (float32)."""
        inv_freq = self._compute_inv_freq(self.base)
        t = torch.arange(self.max_position_embeddings, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def _match_cos_sin_cache_dtype(self, query: Tensor) -> Tensor:
        """The cache on ``query``'s device and dtype; the buffer follows outside compile."""
        cache = self.cos_sin_cache
        if cache.device == query.device and cache.dtype == query.dtype:
            return cache
        cache = cache.to(query.device, dtype=query.dtype)
        if not torch.compiler.is_compiling():  # never reassign a buffer while tracing
            self.cos_sin_cache = cache
        return cache

    def get_cos_sin(self, seqlen: int) -> tuple[Tensor, Tensor]:
        """``cos`` and ``sin`` of the first ``seqlen`` positions, ``[seqlen, rotary_dim/2]``."""
        cos, sin = self.cos_sin_cache[:seqlen].chunk(2, dim=-1)
        return cos, sin


class RotaryEmbedding(RotaryEmbeddingBase):
    """Original rotary positional embedding (neox or GPT-J style, partial rotary allowed).

    ``forward(positions, query, key=None)``: ``positions`` of any shape holding T positions,
    ``query`` ``[..., H*D]`` (or ``[..., H, D]``) with T token rows, ``key`` likewise or
    ``None``. Returns ``(query, key)`` in the input shapes; the platform path rotates them in
    place, ``forward_native`` returns new tensors.
    """

    @staticmethod
    def forward_static(positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
                       rotary_dim: int, cos_sin_cache: Tensor, is_neox_style: bool
                       ) -> tuple[Tensor, Tensor | None]:
        """Plain PyTorch rotary embedding (vLLM's ``RotaryEmbedding.forward_static``)."""
        positions = positions.flatten()
        tokens = positions.shape[0]
        cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)

        def rotate(x: Tensor) -> Tensor:
            heads = x.reshape(tokens, -1, head_size)
            rot = ApplyRotaryEmb.forward_static(heads[..., :rotary_dim], cos, sin,
                                                is_neox_style)
            return torch.cat((rot, heads[..., rotary_dim:]), dim=-1).reshape(x.shape)

        return rotate(query), None if key is None else rotate(key)

    def forward_native(self, positions: Tensor, query: Tensor, key: Tensor | None = None
                       ) -> tuple[Tensor, Tensor | None]:
        cache = self._match_cos_sin_cache_dtype(query)
        return self.forward_static(positions, query, key, self.head_size, self.rotary_dim,
                                   cache, self.is_neox_style)

    def forward_op(self, positions: Tensor, query: Tensor, key: Tensor | None = None
                   ) -> tuple[Tensor, Tensor | None]:
        """The platform path: ``opmux::rotary_embedding`` on ``[T]`` positions and
        ``[T, heads*D]`` rows, written back into ``query`` and ``key`` (in place)."""
        cache = self._match_cos_sin_cache_dtype(query)
        positions = positions.flatten()
        tokens = positions.shape[0]
        q = query.reshape(tokens, query.numel() // max(tokens, 1))
        k = (query.new_empty((tokens, 0)) if key is None
             else key.reshape(tokens, key.numel() // max(tokens, 1)))
        q_out, k_out = rotary_embedding(positions, q, k, cache, self.head_size,
                                        self.is_neox_style)
        query.copy_(q_out.view(query.shape))
        if key is not None:
            key.copy_(k_out.view(key.shape))
        return query, key

    forward_cpu = forward_cuda = forward_xla = forward_npu = forward_op

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
                f"is_neox_style={self.is_neox_style}")


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1 frequency scaling: low frequencies divided by ``scaling_factor``, high ones
    kept, a smooth blend between ``low_freq_factor`` and ``high_freq_factor``."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, dtype: torch.dtype, scaling_factor: float,
                 low_freq_factor: float, high_freq_factor: float,
                 orig_max_position: int) -> None:
        self.scaling_factor = scaling_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.orig_max_position = orig_max_position
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
                         dtype)

    def _compute_inv_freq(self, base: float) -> Tensor:
        inv_freq = super()._compute_inv_freq(base)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = self.orig_max_position / self.low_freq_factor
        high_wavelen = self.orig_max_position / self.high_freq_factor
        smooth: Tensor | float = 0.0
        if self.low_freq_factor != self.high_freq_factor:
            smooth = ((self.orig_max_position / wavelen - self.low_freq_factor)
                      / (self.high_freq_factor - self.low_freq_factor))
        scaled = inv_freq / self.scaling_factor
        blended = (1 - smooth) * scaled + smooth * inv_freq
        return torch.where(wavelen < high_wavelen, inv_freq,
                           torch.where(wavelen > low_wavelen, scaled, blended))


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Linear position interpolation, one cache per scaling factor stacked along dim 0.

    The cache for factor ``f`` has ``max_position_embeddings * f`` rows at positions
    ``t / f``; :attr:`scaling_factor_to_offset` maps each factor to its first row.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, scaling_factors: list[float] | float,
                 dtype: torch.dtype) -> None:
        if isinstance(scaling_factors, (int, float)):
            scaling_factors = [float(scaling_factors)]
        self.scaling_factors: list[float] = list(scaling_factors)
        self._scaling_factor_to_offset: dict[float, int] = {}
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
                         dtype)

    def _compute_cos_sin_cache(self) -> Tensor:
        inv_freq = self._compute_inv_freq(self.base)
        caches: list[Tensor] = []
        offset = 0
        for factor in self.scaling_factors:
            t = torch.arange(self.max_position_embeddings * factor, dtype=torch.float) / factor
            freqs = torch.outer(t, inv_freq)
            caches.append(torch.cat((freqs.cos(), freqs.sin()), dim=-1))
            self._scaling_factor_to_offset[float(factor)] = offset
            offset += caches[-1].shape[0]
        return torch.cat(caches, dim=0)

    @property
    def scaling_factor_to_offset(self) -> dict[float, int]:
        """Scaling factor → first row of its cache in ``cos_sin_cache``."""
        return self._scaling_factor_to_offset


class DynamicNTKScalingRotaryEmbedding(RotaryEmbedding):
    """NTK-aware scaling of the frequency base (vLLM's dynamic NTK: a fixed enlarged base)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 max_trained_positions: int, base: float, is_neox_style: bool,
                 scaling_factor: float, dtype: torch.dtype) -> None:
        self.scaling_factor = scaling_factor
        self.max_trained_positions = max_trained_positions
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
                         dtype)

    def _compute_cos_sin_cache(self) -> Tensor:
        ratio = (self.scaling_factor * self.max_position_embeddings / self.max_trained_positions
                 - (self.scaling_factor - 1))
        base = self.base * ratio ** (self.rotary_dim / (self.rotary_dim - 2))
        inv_freq = self._compute_inv_freq(base)
        t = torch.arange(self.max_position_embeddings, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_position: int) -> float:
    return (dim * math.log(max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between
    (``beta_fast``/``beta_slow`` rotations), and cos/sin scaled by ``mscale``.

    ``max_position_embeddings`` is the original context; the cache has
    ``max_position_embeddings * scaling_factor`` rows.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, scaling_factor: float, dtype: torch.dtype,
                 *, beta_fast: int = 32, beta_slow: int = 1, mscale: float | None = None,
                 mscale_all_dim: float | None = None, attention_factor: float | None = None,
                 truncate: bool = True) -> None:
        self.scaling_factor = scaling_factor
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.truncate = truncate
        if attention_factor is not None:
            self.mscale = float(attention_factor)
        elif mscale and mscale_all_dim:
            self.mscale = float(_yarn_mscale(scaling_factor, mscale)
                                / _yarn_mscale(scaling_factor, mscale_all_dim))
        else:
            self.mscale = float(_yarn_mscale(scaling_factor))
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
                         dtype)

    def _compute_inv_freq(self, scaling_factor: float) -> Tensor:
        dim = self.rotary_dim
        pos_freqs = self.base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        low = _yarn_correction_dim(self.beta_fast, dim, self.base, self.max_position_embeddings)
        high = _yarn_correction_dim(self.beta_slow, dim, self.base,
                                    self.max_position_embeddings)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp  # weight of the original (high) frequencies
        return (1.0 / (scaling_factor * pos_freqs)) * (1 - extrapolate) + (
            1.0 / pos_freqs) * extrapolate

    def _compute_cos_sin_cache(self) -> Tensor:
        inv_freq = self._compute_inv_freq(self.scaling_factor)
        t = torch.arange(self.max_position_embeddings * self.scaling_factor,
                         dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        return torch.cat((freqs.cos() * self.mscale, freqs.sin() * self.mscale), dim=-1)


# ----------------------------------------------------------------- DualChunkRotaryEmbedding
_DUAL_CHUNK_BUFFERS = ("cos_sin_q_cache", "cos_sin_qc_cache", "cos_sin_k_cache",
                       "cos_sin_qc_no_clamp_cache", "cos_sin_q_inter_cache")


@CustomOp.register("dual_chunk_rotary_embedding")
class DualChunkRotaryEmbedding(_RopeLayer):
    """Rotary embedding for Dual Chunk Attention (vLLM's ``DualChunkRotaryEmbedding``).

    Buffers (not persistent): ``cos_sin_q_cache``, ``cos_sin_qc_cache``,
    ``cos_sin_k_cache``, ``cos_sin_qc_no_clamp_cache``, ``cos_sin_q_inter_cache`` (see
    :func:`opmux.ops.rotary.make_dual_chunk_caches`), built on the default device.
    ``forward(positions, query, key, offsets=None)`` returns new tensors: the query rotated
    five ways and concatenated along the last dimension (``[T, 5*H*D]``), and the key
    (``[T, Hkv*D]``); like vLLM's layer, a leading dimension of size 1 is squeezed away
    (so a single token gives 1-d results).
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, dtype: torch.dtype, chunk_size: int,
                 local_size: int) -> None:
        super().__init__()
        if chunk_size <= local_size or local_size < 0:
            raise ConfigError(f"DualChunkRotaryEmbedding: need 0 <= local_size < chunk_size, "
                              f"got chunk_size={chunk_size}, local_size={local_size}")
        self._init_rope(head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
                        dtype)
        self.chunk_size = chunk_size
        self.local_size = local_size
        self.cos_sin_q_cache: Tensor
        self.cos_sin_qc_cache: Tensor
        self.cos_sin_k_cache: Tensor
        self.cos_sin_qc_no_clamp_cache: Tensor
        self.cos_sin_q_inter_cache: Tensor
        caches = make_dual_chunk_caches(chunk_size, local_size, max_position_embeddings,
                                        rotary_dim, base, dtype)
        for name, cache in zip(_DUAL_CHUNK_BUFFERS, caches, strict=True):
            self.register_buffer(name, cache, persistent=False)

    def _rotate(self, cos_sin: Tensor, rot: Tensor, passthrough: Tensor | None) -> Tensor:
        cos, sin = cos_sin.unsqueeze(-2).chunk(2, dim=-1)
        out = _rotate_halves(rot, cos, sin, self.is_neox_style)
        if passthrough is not None:
            out = torch.cat((out, passthrough), dim=-1)
        return out.flatten(-2).squeeze(0)

    def forward_native(self, positions: Tensor, query: Tensor, key: Tensor,
                       offsets: Tensor | None = None) -> tuple[Tensor, Tensor]:
        query = query.view(*query.shape[:-1], -1, self.head_size)
        key = key.view(*key.shape[:-1], -1, self.head_size)
        split = self.rotary_dim < self.head_size
        q_rot, k_rot = query[..., : self.rotary_dim], key[..., : self.rotary_dim]
        q_pass = query[..., self.rotary_dim:] if split else None
        k_pass = key[..., self.rotary_dim:] if split else None
        pos = positions if offsets is None else positions + offsets
        in_chunk = pos % (self.chunk_size - self.local_size)
        key_out = self._rotate(self.cos_sin_k_cache[pos], k_rot, k_pass)
        last = self.chunk_size - self.local_size - 1
        rows = (self.cos_sin_q_cache[in_chunk], self.cos_sin_qc_cache[in_chunk],
                self.cos_sin_qc_cache[last].repeat(positions.shape[0], 1),
                self.cos_sin_qc_no_clamp_cache[in_chunk], self.cos_sin_q_inter_cache[in_chunk])
        query_out = torch.cat([self._rotate(r, q_rot, q_pass) for r in rows], dim=-1)
        return query_out, key_out

    def forward_op(self, positions: Tensor, query: Tensor, key: Tensor,
                   offsets: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The platform path: ``opmux::dual_chunk_rotary_embedding`` on ``[T]`` positions."""
        pos = positions.flatten()
        tokens = pos.shape[0]
        width, kv_width = query.shape[-1], key.shape[-1]
        q_out, k_out = dual_chunk_rotary_embedding(
            pos, query.reshape(tokens, width), key.reshape(tokens, kv_width),
            self.cos_sin_q_cache, self.cos_sin_qc_cache, self.cos_sin_k_cache,
            self.cos_sin_qc_no_clamp_cache, self.cos_sin_q_inter_cache, self.head_size,
            self.is_neox_style, None if offsets is None else offsets.flatten())
        return (q_out.view(*query.shape[:-1], 5 * width).squeeze(0),
                k_out.view(key.shape).squeeze(0))

    forward_cpu = forward_cuda = forward_xla = forward_npu = forward_op

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
                f"is_neox_style={self.is_neox_style}, chunk_size={self.chunk_size}, "
                f"local_size={self.local_size}")


# ------------------------------------------------------------------------------- get_rope
_ROPE_CACHE: dict[tuple[Any, ...], RotaryEmbeddingBase | DualChunkRotaryEmbedding] = {}

ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "yarn")
"""``rope_type`` values :func:`get_rope` builds (``type`` is accepted as an alias key)."""

_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
              "truncate")


def _hashable(params: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    if params is None:
        return None
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items())


def _need(params: dict[str, Any], rope_type: str, key: str) -> Any:
    if key not in params:
        raise ConfigError(f"get_rope: rope_type {rope_type!r} needs {key!r} in rope_parameters"
                          f", got keys {sorted(params)}")
    return params[key]


def get_rope(head_size: int, max_position: int, is_neox_style: bool = True,
             rope_parameters: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
             dual_chunk_attention_config: dict[str, Any] | None = None
             ) -> RotaryEmbeddingBase | DualChunkRotaryEmbedding:
    """Build (or reuse) the rope layer a model config asks for, as vLLM's ``get_rope``.

    ``rope_parameters`` is the Hugging Face ``rope_scaling`` dict plus ``rope_theta``
    (default 10000), optionally ``partial_rotary_factor`` or ``rope_dim``. ``rope_type``
    (or the older ``type``) picks the class: ``default`` → :class:`RotaryEmbedding`,
    ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``), ``linear`` (``factor``), ``dynamic``
    (``factor``, optional ``max_trained_positions``), ``yarn`` (``factor``,
    ``original_max_position_embeddings``, optional ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim``, ``attention_factor``, ``truncate``). A
    ``dual_chunk_attention_config`` (``chunk_size``, ``local_size``) builds
    :class:`DualChunkRotaryEmbedding`. Layers are shared: equal arguments return the same
    module (:func:`reset_rope_cache` forgets them).

    :param dtype: cache dtype (default: ``torch.get_default_dtype()``).
    :raises opmux.ConfigError: unknown ``rope_type``, missing keys, or a bad
        ``partial_rotary_factor``.
    """
    if dtype is None:
        dtype = torch.get_default_dtype()
    params = dict(rope_parameters or {})
    base = params.get("rope_theta", 10000)
    rope_type = params.get("rope_type", params.get("type", "default"))
    rotary_dim = params.get("rope_dim")
    if not rotary_dim:
        factor = params.get("partial_rotary_factor", 1.0)
        if not 0.0 < factor <= 1.0:
            raise ConfigError(f"get_rope: partial_rotary_factor must be in (0, 1], got {factor}")
        rotary_dim = int(head_size * factor)
    key = (head_size, rotary_dim, max_position, is_neox_style, _hashable(rope_parameters),
           _hashable({k: v for k, v in (dual_chunk_attention_config or {}).items()
                      if k != "sparse_attention_config"}
                     if dual_chunk_attention_config is not None else None), dtype)
    cached = _ROPE_CACHE.get(key)
    if cached is not None:
        return cached
    layer: RotaryEmbeddingBase | DualChunkRotaryEmbedding
    if dual_chunk_attention_config is not None:
        cfg = dual_chunk_attention_config
        layer = DualChunkRotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style, dtype,
            chunk_size=_need(cfg, "dual_chunk", "chunk_size"),
            local_size=_need(cfg, "dual_chunk", "local_size"))
    elif rope_type == "default":
        layer = RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style,
                                dtype)
    elif rope_type == "llama3":
        layer = Llama3RotaryEmbedding(
            head_size, rotary_dim, max_position, base, is_neox_style, dtype,
            _need(params, rope_type, "factor"), _need(params, rope_type, "low_freq_factor"),
            _need(params, rope_type, "high_freq_factor"),
            _need(params, rope_type, "original_max_position_embeddings"))
    elif rope_type == "linear":
        layer = LinearScalingRotaryEmbedding(head_size, rotary_dim, max_position, base,
                                             is_neox_style, _need(params, rope_type, "factor"),
                                             dtype)
    elif rope_type == "dynamic":
        layer = DynamicNTKScalingRotaryEmbedding(
            head_size, rotary_dim, max_position,
            params.get("max_trained_positions", max_position), base, is_neox_style,
            _need(params, rope_type, "factor"), dtype)
    elif rope_type == "yarn":
        layer = YaRNScalingRotaryEmbedding(
            head_size, rotary_dim, _need(params, rope_type, "original_max_position_embeddings"),
            base, is_neox_style, _need(params, rope_type, "factor"), dtype,
            **{k: v for k, v in params.items() if k in _YARN_KEYS})
    else:
        raise ConfigError(f"get_rope: unknown rope_type {rope_type!r}; opmux builds "
                          f"{sorted(ROPE_TYPES)}")
    _ROPE_CACHE[key] = layer
    return layer


def reset_rope_cache() -> None:
    """Forget the layers :func:`get_rope` shares (tests; a changed enablement string)."""
    _ROPE_CACHE.clear()
