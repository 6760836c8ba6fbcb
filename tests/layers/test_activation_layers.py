"""The activation layers against references written here from vLLM 0.32's ``forward_native``
(same constructor arguments), enabled (platform path -> catalog op -> ``cpp``) and disabled
(``forward_native``), in fp32 / bf16 / fp16; vLLM's names; fullgraph compilation."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import opmux
from opmux import layers
from opmux.testing.conformance import TOLERANCES

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


pytestmark = pytest.mark.usefixtures("plugins_no_grad")


def _half(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def _ref_sparse(p: float, approximate: str) -> Callable[[torch.Tensor], torch.Tensor]:
    m = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(p)).item()

    def fn(x: torch.Tensor) -> torch.Tensor:
        g, u = _half(x)
        cut = g.mean(-1, keepdim=True) + g.std(-1, keepdim=True, unbiased=False) * m
        return F.gelu(F.relu(g - cut), approximate=approximate) * u
    return fn


def _ref_swiglu(alpha: float, limit: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        g, u = x[..., ::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
        glu = g * torch.sigmoid(g * alpha)
        return (u + 1) * glu
    return fn


def _ref_xielu(ap0: float, an0: float, beta: float, eps: float,
               dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    raw_p = torch.log(torch.exp(torch.tensor(ap0, dtype=dtype)) - 1).unsqueeze(0)
    raw_n = torch.log(torch.exp(torch.tensor(an0 - beta, dtype=dtype)) - 1).unsqueeze(0)
    b, e = torch.tensor(beta, dtype=dtype), torch.tensor(eps, dtype=dtype)

    def fn(x: torch.Tensor) -> torch.Tensor:
        a_p = F.softplus(raw_p)
        a_n = b + F.softplus(raw_n)
        return torch.where(x > 0, a_p * x * x + b * x,
                           (torch.expm1(torch.min(x, e)) - x) * a_n + b * x)
    return fn


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))


#: name -> (layer factory, reference, gated input)
LAYERS: dict[str, tuple[Callable[[], opmux.CustomOp], Callable[[torch.Tensor], torch.Tensor]]] = {
    "silu_and_mul": (lambda: layers.SiluAndMul(),
                     lambda x: F.silu(_half(x)[0]) * _half(x)[1]),
    "mul_and_silu": (lambda: layers.MulAndSilu(),
                     lambda x: _half(x)[0] * F.silu(_half(x)[1])),
    "fatrelu_and_mul": (lambda: layers.FatreluAndMul(threshold=0.25),
                        lambda x: F.threshold(_half(x)[0], 0.25, 0.0) * _half(x)[1]),
    "gelu_and_mul": (lambda: layers.GeluAndMul(approximate="tanh"),
                     lambda x: F.gelu(_half(x)[0], approximate="tanh") * _half(x)[1]),
    "gelu_and_mul_sparse": (lambda: layers.GeluAndMulSparse(activation_sparsity=0.95,
                                                             approximate="tanh"),
                            _ref_sparse(0.95, "tanh")),
    "swigluoai_and_mul": (lambda: layers.SwigluOAIAndMul(alpha=1.702, limit=7.0),
                          _ref_swiglu(1.702, 7.0)),
    "gelu_new": (lambda: layers.NewGELU(), _tanh_gelu),
    "gelu_fast": (lambda: layers.FastGELU(),
                  lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608
                                                        * (1.0 + 0.044715 * x * x)))),
    "quick_gelu": (lambda: layers.QuickGELU(), lambda x: x * torch.sigmoid(1.702 * x)),
    "relu2": (lambda: layers.ReLUSquaredActivation(), lambda x: torch.square(F.relu(x))),
    "xielu": (lambda: layers.XIELU(alpha_p_init=1.1, alpha_n_init=0.6, beta=0.5, eps=-1e-6,
                                   dtype=torch.bfloat16),
              _ref_xielu(1.1, 0.6, 0.5, -1e-6, torch.bfloat16)),
}

CLASS_NAMES = {"silu_and_mul": "SiluAndMul", "mul_and_silu": "MulAndSilu",
               "fatrelu_and_mul": "FatreluAndMul", "gelu_and_mul": "GeluAndMul",
               "gelu_and_mul_sparse": "GeluAndMulSparse", "swigluoai_and_mul": "SwigluOAIAndMul",
               "gelu_new": "NewGELU", "gelu_fast": "FastGELU", "quick_gelu": "QuickGELU",
               "relu2": "ReLUSquaredActivation", "xielu": "XIELU"}


def _input(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(3, 5, 2 * 48, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_matches_reference(name: str, dtype: torch.dtype, enabled: bool) -> None:
    opmux.set_custom_ops("all" if enabled else "none")
    make, ref = LAYERS[name]
    layer = make()
    assert type(layer).__name__ == CLASS_NAMES[name] and type(layer).name == name
    assert opmux.CustomOp.op_registry[name] is type(layer)
    method = layer.forward.__func__  # type: ignore[attr-defined]
    # the platform path is a _runs alias: dispatch binds its target, the catalog op path
    assert method is (type(layer).forward_op if enabled else type(layer).forward_native)
    x = _input(dtype)
    got, want = layer(x), ref(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    atol, rtol = TOLERANCES[want.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    if not enabled:  # the same PyTorch ops in the same order
        assert torch.equal(got, want)
    counts = opmux.custom_op_counts()["enabled" if enabled else "disabled"]
    assert counts[name] == 1


def test_enabled_layers_call_the_catalog_op(op_calls: Callable[[str], list[dict[str, Any]]]
                                           ) -> None:
    op = opmux.get_op("gelu_new")
    x = _input(torch.float32)
    assert op.dispatch(x).provider == "cpp", op.explain(x)
    calls = op_calls("gelu_new")
    layers.NewGELU()(x)
    opmux.set_custom_ops("all,-gelu_new")
    layers.NewGELU()(x)
    assert len(calls) == 1 and calls[0]["x"] is x


def test_constructor_checks_and_vllm_attributes() -> None:
    with pytest.raises(ValueError, match="Unknown approximate mode"):
        layers.GeluAndMul(approximate="erf")
    with pytest.raises(ValueError, match="Please use GeluAndMul"):
        layers.GeluAndMulSparse(activation_sparsity=0.0)
    sparse = layers.GeluAndMulSparse(0.95)
    assert sparse.std_multiplier == pytest.approx(1.6448536, 1e-6)
    assert sparse.approximate == "none"
    swiglu = layers.SwigluOAIAndMul()
    assert (swiglu.alpha, swiglu.limit) == (1.702, 7.0)
    assert layers.FatreluAndMul().threshold == 0.0
    layers.SiluAndMul(compile_native=False)
    layers.ReLUSquaredActivation(compile_native=False)


def test_xielu_parameters_and_state_dict() -> None:
    a = layers.XIELU()
    assert dict(a.named_parameters()).keys() == {"alpha_p", "alpha_n"}
    assert dict(a.named_buffers()).keys() == {"beta", "eps"}
    assert a.alpha_p.shape == (1,) and a.alpha_p.dtype == torch.bfloat16
    b = layers.XIELU(alpha_p_init=2.0, beta=0.25, eps=-1e-3, dtype=torch.float32)
    b.load_state_dict(a.state_dict())
    assert b.beta.item() == 0.5 and b.alpha_p.dtype == torch.float32
    x = _input(torch.float32)
    # the platform path reads the loaded beta too (the op takes it as a Python float)
    torch.testing.assert_close(b(x), a.forward_native(x), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_compiles_fullgraph_without_breaks(name: str) -> None:
    layer = LAYERS[name][0]()
    x = _input(torch.float32)
    explained: Any = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_compile_mode_disables_layers_and_compiles_their_native_code() -> None:
    opmux.set_compile_mode("inductor")
    layer = layers.NewGELU()
    assert layer.forward.__func__ is layers.NewGELU.forward_native  # type: ignore[attr-defined]
    x = _input(torch.float32)
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
