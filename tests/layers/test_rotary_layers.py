"""The rotary layers against references of ours, on both forward paths, and compiled.

The references are written independently of the layers: cache frequencies from the formulas
of Hugging Face transformers' rope utilities (re-derived here in float64), rotations as
complex multiplications.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

import opmux
from opmux.layers import (
    ApplyRotaryEmb,
    DualChunkRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding,
    LinearScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
    RotaryEmbedding,
    YaRNScalingRotaryEmbedding,
    get_rope,
    reset_rope_cache,
)
from opmux.testing import TOLERANCES

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEAD, ROT, MAX_POS, BASE = 64, 32, 512, 10000.0


@pytest.fixture(autouse=True)
def _isolated(fresh_custom_ops: None) -> Iterator[None]:
    opmux.load_plugins()  # the platform path then reaches the cpp provider
    reset_rope_cache()
    with torch.no_grad():
        yield
    reset_rope_cache()


def _close(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want.double(), atol=atol, rtol=rtol)


# ------------------------------------------------------------------- reference frequencies
def _default_inv_freq(dim: int, base: float) -> Tensor:
    return torch.tensor([base ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)


def _llama3_inv_freq(dim: int, base: float, factor: float, low: float, high: float,
                     old_context: int) -> Tensor:
    out = []
    for f in _default_inv_freq(dim, base).tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old_context / high:
            out.append(f)
        elif wavelen > old_context / low:
            out.append(f / factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def _yarn_inv_freq_and_mscale(dim: int, base: float, factor: float, original: int,
                              beta_fast: float, beta_slow: float, mscale: float | None,
                              mscale_all_dim: float | None) -> tuple[Tensor, float]:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(_default_inv_freq(dim, base).tolist()):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        att = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    else:
        att = get_mscale(factor)
    return torch.tensor(out, dtype=torch.float64), att


def _cache(positions: Tensor, inv_freq: Tensor, scale: float = 1.0) -> Tensor:
    angles = positions.double()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos() * scale, angles.sin() * scale), dim=-1)


# variant name -> (build(dtype), reference cache [rows, ROT] in float64)
def _variants() -> dict[str, tuple[Callable[[torch.dtype], Any], Tensor]]:
    rows = torch.arange(MAX_POS)
    llama = _llama3_inv_freq(ROT, 500000.0, 8.0, 1.0, 4.0, 128)
    dyn_base = BASE * ((2.0 * MAX_POS / 256) - 1.0) ** (ROT / (ROT - 2))
    yarn, att = _yarn_inv_freq_and_mscale(ROT, BASE, 4.0, 128, 32, 1, 0.707, 0.707)
    yarn_plain, att_plain = _yarn_inv_freq_and_mscale(ROT, BASE, 2.0, 256, 16, 2, None, None)
    linear = torch.cat([_cache(torch.arange(MAX_POS * f) / f, _default_inv_freq(ROT, BASE))
                        for f in (1.0, 2.0)])
    return {
        "default": (lambda dt: RotaryEmbedding(HEAD, ROT, MAX_POS, BASE, True, dt),
                    _cache(rows, _default_inv_freq(ROT, BASE))),
        "llama3": (lambda dt: Llama3RotaryEmbedding(HEAD, ROT, MAX_POS, 500000.0, True, dt,
                                                    8.0, 1.0, 4.0, 128),
                   _cache(rows, llama)),
        "linear": (lambda dt: LinearScalingRotaryEmbedding(HEAD, ROT, MAX_POS, BASE, True,
                                                           [1.0, 2.0], dt), linear),
        "dynamic": (lambda dt: DynamicNTKScalingRotaryEmbedding(HEAD, ROT, MAX_POS, 256, BASE,
                                                                True, 2.0, dt),
                    _cache(rows, _default_inv_freq(ROT, dyn_base))),
        "yarn": (lambda dt: YaRNScalingRotaryEmbedding(HEAD, ROT, 128, BASE, True, 4.0, dt,
                                                       mscale=0.707, mscale_all_dim=0.707),
                 _cache(rows, yarn, att)),
        "yarn-no-mscale": (lambda dt: YaRNScalingRotaryEmbedding(
            HEAD, ROT, 256, BASE, False, 2.0, dt, beta_fast=16, beta_slow=2),
            _cache(rows, yarn_plain, att_plain)),
    }


VARIANTS = _variants()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cos_sin_cache_matches_reference_formulas(name: str) -> None:
    build, want = VARIANTS[name]
    layer = build(torch.float32)
    assert layer.cos_sin_cache.dtype == torch.float32
    assert "cos_sin_cache" not in layer.state_dict()  # not persistent, as vLLM's
    # fp32 angles (position * inv_freq) carry ~position * 6e-8 of error
    torch.testing.assert_close(layer.cos_sin_cache.double(), want, atol=1e-4, rtol=0)
    assert build(torch.bfloat16).cos_sin_cache.dtype == torch.bfloat16


def test_linear_scaling_offsets() -> None:
    layer = LinearScalingRotaryEmbedding(HEAD, ROT, 100, BASE, True, [1.0, 2.0, 4.0],
                                         torch.float32)
    assert layer.scaling_factor_to_offset == {1.0: 0, 2.0: 100, 4.0: 300}
    assert layer.cos_sin_cache.shape == (700, ROT)


# ------------------------------------------------------------------------- rotary outputs
def _rotate_ref(x: Tensor, positions: Tensor, cache: Tensor, head: int, rot: int,
                neox: bool) -> Tensor:
    """Rotate the first ``rot`` dims of every head of ``x[T, ...]`` by ``cache[positions]``
    (float64 cos/sin), as a complex multiplication."""
    t = positions.numel()
    heads = x.reshape(t, -1, head).double().clone()
    cos, sin = cache[positions.flatten()].double().chunk(2, dim=-1)
    r = heads[..., :rot]
    z = (torch.complex(r[..., : rot // 2], r[..., rot // 2:]) if neox
         else torch.complex(r[..., 0::2], r[..., 1::2]))
    z = z * torch.complex(cos, sin).unsqueeze(1)
    heads[..., :rot] = (torch.cat((z.real, z.imag), -1) if neox
                        else torch.stack((z.real, z.imag), -1).flatten(-2))
    return heads.reshape(x.shape)


def _layer_inputs(dtype: torch.dtype, rows: int, positions_shape: tuple[int, ...]
                  ) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(7)
    positions = torch.randint(0, rows, positions_shape, generator=g)
    positions.view(-1)[0] = rows - 1
    query = torch.randn(*positions_shape, 4 * HEAD, generator=g).to(dtype)
    key = torch.randn(*positions_shape, 2 * HEAD, generator=g).to(dtype)
    return positions, query, key


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rotary_layers_match_reference(name: str, dtype: torch.dtype, enabled: bool) -> None:
    opmux.set_custom_ops("all" if enabled else "all,-rotary_embedding")
    build, cache = VARIANTS[name]
    layer = build(dtype)
    assert layer.forward.__name__ == ("forward_op" if enabled else "forward_native")
    for shape in ((9,), (2, 5)):
        positions, query, key = _layer_inputs(dtype, cache.shape[0], shape)
        q0, k0 = query.clone(), key.clone()
        got_q, got_k = layer(positions, query, key)
        neox = layer.is_neox_style
        _close(got_q, _rotate_ref(q0, positions, cache, HEAD, ROT, neox), dtype)
        assert got_k is not None
        _close(got_k, _rotate_ref(k0, positions, cache, HEAD, ROT, neox), dtype)
        if enabled:  # vLLM's platform path rotates in place and returns its inputs
            assert got_q is query and got_k is key
        else:  # forward_native leaves its inputs alone
            assert torch.equal(query, q0) and torch.equal(key, k0)
        q_only, no_key = layer(positions, q0.clone(), None)
        assert no_key is None
        _close(q_only, _rotate_ref(q0, positions, cache, HEAD, ROT, neox), dtype)


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_rotary_on_qkv_slices(enabled: bool) -> None:
    """q and k as column slices of one qkv tensor (how attention layers split it): the
    platform path writes through the views into qkv and leaves v alone."""
    opmux.set_custom_ops("all" if enabled else "none")
    build, cache = VARIANTS["llama3"]
    layer = build(torch.float32)
    positions = torch.randint(0, MAX_POS, (5,))
    qkv = torch.randn(5, (4 + 2 + 2) * HEAD)
    before = qkv.clone()
    q, k = qkv[:, : 4 * HEAD], qkv[:, 4 * HEAD: 6 * HEAD]
    got_q, got_k = layer(positions, q, k)
    _close(got_q, _rotate_ref(before[:, : 4 * HEAD], positions, cache, HEAD, ROT, True),
           torch.float32)
    assert got_k is not None
    _close(got_k, _rotate_ref(before[:, 4 * HEAD: 6 * HEAD], positions, cache, HEAD, ROT,
                              True), torch.float32)
    assert torch.equal(qkv[:, 6 * HEAD:], before[:, 6 * HEAD:])
    assert torch.equal(qkv[:, : 4 * HEAD], got_q) == enabled


def test_cache_follows_query_dtype() -> None:
    layer = RotaryEmbedding(HEAD, HEAD, 64, BASE, False, torch.float32)
    positions, query, key = _layer_inputs(torch.bfloat16, 64, (5,))
    layer(positions, query, key)
    assert layer.cos_sin_cache.dtype == torch.bfloat16


def test_bad_configuration_is_an_error() -> None:
    with pytest.raises(opmux.ConfigError, match="rotary_dim must be even"):
        RotaryEmbedding(64, 65, 128, BASE, True, torch.float32)
    with pytest.raises(opmux.ConfigError, match="local_size < chunk_size"):
        DualChunkRotaryEmbedding(64, 64, 128, BASE, True, torch.float32, 16, 16)


# ------------------------------------------------------------------------------- get_rope
def test_get_rope_maps_rope_types() -> None:
    f32 = torch.float32
    llama = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 128}
    layer = get_rope(HEAD, MAX_POS, True, llama, f32)
    assert type(layer) is Llama3RotaryEmbedding and layer.rotary_dim == HEAD
    assert get_rope(HEAD, MAX_POS, True, dict(llama), f32) is layer  # shared, like vLLM
    assert type(get_rope(HEAD, MAX_POS, True, None, f32)) is RotaryEmbedding
    assert type(get_rope(HEAD, MAX_POS, True, {"type": "linear", "factor": 2.0}, f32)
                ) is LinearScalingRotaryEmbedding
    dyn = get_rope(HEAD, MAX_POS, True, {"rope_type": "dynamic", "factor": 2.0}, f32)
    assert type(dyn) is DynamicNTKScalingRotaryEmbedding
    assert dyn.max_trained_positions == MAX_POS
    yarn = get_rope(HEAD, MAX_POS, True, {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16,
                                          "original_max_position_embeddings": 128}, f32)
    assert type(yarn) is YaRNScalingRotaryEmbedding and yarn.beta_fast == 16
    assert yarn.cos_sin_cache.shape == (512, HEAD)
    partial = get_rope(HEAD, MAX_POS, False, {"partial_rotary_factor": 0.5}, f32)
    assert partial.rotary_dim == HEAD // 2 and not partial.is_neox_style
    dual = get_rope(HEAD, MAX_POS, True, None, f32,
                    dual_chunk_attention_config={"chunk_size": 64, "local_size": 16,
                                                 "sparse_attention_config": {"x": 1}})
    assert type(dual) is DualChunkRotaryEmbedding and dual.chunk_size == 64


def test_get_rope_errors() -> None:
    with pytest.raises(opmux.ConfigError, match=r"unknown rope_type 'longrope'.*'default'"):
        get_rope(HEAD, MAX_POS, True, {"rope_type": "longrope"})
    with pytest.raises(opmux.ConfigError, match="needs 'low_freq_factor'"):
        get_rope(HEAD, MAX_POS, True, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(opmux.ConfigError, match="partial_rotary_factor"):
        get_rope(HEAD, MAX_POS, True, {"partial_rotary_factor": 1.5})


# ------------------------------------------------------------------------- ApplyRotaryEmb
@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("fp32", [False, True], ids=["native-dtype", "fp32-compute"])
def test_apply_rotary_emb_matches_reference(neox: bool, fp32: bool, dtype: torch.dtype,
                                            enabled: bool) -> None:
    opmux.set_custom_ops("all" if enabled else "all,-apply_rotary_emb")
    layer = ApplyRotaryEmb(is_neox_style=neox, enable_fp32_compute=fp32)
    assert layer.forward.__name__ == ("forward_op" if enabled else "forward_native")
    g = torch.Generator().manual_seed(3)
    seq, heads, d = 6, 3, 32
    angles = torch.rand(seq, d // 2, generator=g, dtype=torch.float64) * 6.3
    cache = torch.cat((angles.cos(), angles.sin()), -1)
    for shape in ((seq, heads, d), (2, seq, heads, d)):
        x = torch.randn(*shape, generator=g).to(dtype)
        cos, sin = cache.to(dtype).chunk(2, -1)
        got = layer(x, cos, sin)
        assert got.dtype == dtype and got.shape == x.shape
        # reference: each (batch, position) row rotated by its position's angles
        flat = x.reshape(-1, seq, heads * d)
        want = torch.stack([_rotate_ref(b, torch.arange(seq), cache, d, d, neox) for b in flat])
        _close(got, want.reshape(shape), dtype)


def test_apply_rotary_emb_enforce_enable() -> None:
    opmux.set_custom_ops("none")
    assert ApplyRotaryEmb().forward.__name__ == "forward_native"
    assert ApplyRotaryEmb(enforce_enable=True).forward.__name__ == "forward_op"


# ---------------------------------------------------------------- DualChunkRotaryEmbedding
def _dual_chunk_ref(layer: DualChunkRotaryEmbedding, positions: Tensor, query: Tensor,
                    key: Tensor) -> tuple[Tensor, Tensor]:
    """Each rotation written as the angle of a position: intra ``p % L``, successive
    ``min(p % L + L, chunk)``, inter ``min(2L - 1, chunk)``, the critical ones ``p % L + L``
    and ``p % L + chunk`` (L = chunk_size - local_size); the key at ``p % L``."""
    chunk, length = layer.chunk_size, layer.chunk_size - layer.local_size
    inv = _default_inv_freq(layer.rotary_dim, layer.base)
    table = _cache(torch.arange(4 * chunk + layer.max_position_embeddings), inv)
    p = positions % length
    angle_positions = [p, (p + length).clamp(max=chunk),
                       torch.full_like(p, min(2 * length - 1, chunk)), p + length, p + chunk]
    args = (layer.head_size, layer.rotary_dim, layer.is_neox_style)
    q = torch.cat([_rotate_ref(query, a, table, *args) for a in angle_positions], dim=-1)
    return q, _rotate_ref(key, p, table, *args)


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("neox,rot", [(True, HEAD), (False, HEAD), (True, ROT)],
                         ids=["neox", "gptj", "neox-partial"])
def test_dual_chunk_matches_reference(neox: bool, rot: int, dtype: torch.dtype,
                                      enabled: bool) -> None:
    opmux.set_custom_ops("all" if enabled else "all,-dual_chunk_rotary_embedding")
    layer = DualChunkRotaryEmbedding(HEAD, rot, 256, BASE, neox, dtype, chunk_size=48,
                                     local_size=16)
    assert layer.forward.__name__ == ("forward_op" if enabled else "forward_native")
    g = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 200, (7,), generator=g)
    offsets = torch.randint(0, 50, (7,), generator=g)
    query = torch.randn(7, 4 * HEAD, generator=g).to(dtype)
    key = torch.randn(7, 2 * HEAD, generator=g).to(dtype)
    q0, k0 = query.clone(), key.clone()
    got_q, got_k = layer(positions, query, key)
    want_q, want_k = _dual_chunk_ref(layer, positions, q0, k0)
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    assert torch.equal(query, q0) and torch.equal(key, k0)  # new tensors on both paths
    # one token: vLLM's layer squeezes the token dimension away
    one_q, one_k = layer(positions[:1], query[:1], key[:1])
    assert one_q.shape == (5 * 4 * HEAD,) and one_k.shape == (2 * HEAD,)
    _close(one_q, want_q[0], dtype)
    _close(one_k, want_k[0], dtype)
    got_q, got_k = layer(positions, query, key, offsets)
    want_q, want_k = _dual_chunk_ref(layer, positions + offsets, q0, k0)
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_dual_chunk_leading_batch_of_one(enabled: bool) -> None:
    """``query [1, T, H*D]`` with ``positions [T]``: vLLM's layer squeezes the batch away."""
    opmux.set_custom_ops("all" if enabled else "none")
    layer = DualChunkRotaryEmbedding(HEAD, HEAD, 256, BASE, True, torch.float32, 48, 16)
    positions = torch.randint(0, 256, (6,))
    query, key = torch.randn(1, 6, 2 * HEAD), torch.randn(1, 6, HEAD)
    got_q, got_k = layer(positions, query, key)
    want_q, want_k = _dual_chunk_ref(layer, positions, query[0], key[0])
    _close(got_q, want_q, torch.float32)
    _close(got_k, want_k, torch.float32)


def test_dual_chunk_buffers_like_vllm() -> None:
    layer = DualChunkRotaryEmbedding(HEAD, HEAD, 256, BASE, True, torch.float32, 48, 16)
    names = {n for n, _ in layer.named_buffers()}
    assert names == {"cos_sin_q_cache", "cos_sin_qc_cache", "cos_sin_k_cache",
                     "cos_sin_qc_no_clamp_cache", "cos_sin_q_inter_cache"}
    assert layer.cos_sin_k_cache.shape == (256, HEAD)
    assert layer.cos_sin_q_cache.shape == (32, HEAD)
    assert layer.state_dict() == {}


# -------------------------------------------------------------------------------- compile
def _compile_cases() -> dict[str, tuple[Callable[[], torch.nn.Module], tuple[Any, ...]]]:
    g = torch.Generator().manual_seed(11)
    pos = torch.randint(0, 128, (6,), generator=g)
    q, k = torch.randn(6, 4 * HEAD, generator=g), torch.randn(6, 2 * HEAD, generator=g)
    x = torch.randn(2, 6, 3, 32, generator=g)
    ang = torch.rand(6, 16, generator=g)
    cases: dict[str, tuple[Callable[[], torch.nn.Module], tuple[Any, ...]]] = {
        name: (lambda b=build: b(torch.float32), (pos, q, k))
        for name, (build, _) in VARIANTS.items()}
    cases["apply_rotary_emb"] = (lambda: ApplyRotaryEmb(is_neox_style=False),
                                 (x, ang.cos(), ang.sin()))
    cases["dual_chunk"] = (lambda: DualChunkRotaryEmbedding(HEAD, ROT, 256, BASE, True,
                                                            torch.float32, 48, 16), (pos, q, k))
    return cases


COMPILE_CASES = _compile_cases()


def _fresh(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, Tensor) else a for a in args)


def _check_compiled(name: str, backend: str) -> None:
    build, args = COMPILE_CASES[name]
    layer = build()
    want = layer(*_fresh(args))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(layer)(*_fresh(args))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    got = compiled(*_fresh(args))
    for g_, w_ in zip(got if isinstance(got, tuple) else (got,),
                      want if isinstance(want, tuple) else (want,), strict=True):
        torch.testing.assert_close(g_, w_, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("name", sorted(COMPILE_CASES))
def test_layers_compile_fullgraph(name: str, enabled: bool) -> None:
    opmux.set_custom_ops("all" if enabled else "none")
    _check_compiled(name, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["default", "llama3", "apply_rotary_emb", "dual_chunk"])
def test_layers_compile_inductor(name: str) -> None:
    _check_compiled(name, "inductor")


@pytest.mark.parametrize("theta", [0, -10000.0, float("nan"), float("inf"), True, "10000"])
@pytest.mark.parametrize("rope_type", [{}, {"rope_type": "linear", "factor": 2.0},
                                       {"rope_type": "dynamic", "factor": 2.0}])
def test_get_rope_refuses_a_theta_that_is_not_positive(theta: Any,
                                                       rope_type: dict[str, Any]) -> None:
    reset_rope_cache()
    with pytest.raises(opmux.ConfigError, match=r"base \(rope_theta\) must be a finite number "
                                                r"> 0, got"):
        get_rope(8, 16, True, {"rope_theta": theta, **rope_type})


def test_dual_chunk_rope_refuses_theta_zero() -> None:
    with pytest.raises(opmux.ConfigError, match=r"rope_theta"):
        get_rope(8, 16, True, {"rope_theta": 0}, torch.float32,
                 {"chunk_size": 8, "local_size": 2})
