"""Activation layers: vLLM 0.32's activation rows of the CustomOp table.

Each class has vLLM's name, registered name, constructor arguments, parameter and buffer
names, and ``forward_native`` result (plain PyTorch, in the input's dtype as vLLM computes
it). The platform paths (``forward_cpu``, ``forward_cuda``, ``forward_xla``, ``forward_npu``;
``forward_hip`` follows ``forward_cuda``) call the catalog op of the row, so every
provider (``cpp``, ``triton``, third-party plugins) serves the layer; providers compute in
fp32 and round once, within the conformance tolerances of the PyTorch result.

``compile_native`` (vLLM's switch for compiling ``forward_native`` separately) is accepted
where vLLM has it and ignored: opmux layers are compiled with the model.

>>> import torch
>>> from opmux.layers import SiluAndMul
>>> tuple(SiluAndMul()(torch.randn(2, 8)).shape)
(2, 4)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from opmux.layers.custom_op import CustomOp, _OpLayer
from opmux.ops import activation as ops

__all__ = [
    "XIELU",
    "FastGELU",
    "FatreluAndMul",
    "GeluAndMul",
    "GeluAndMulSparse",
    "MulAndSilu",
    "NewGELU",
    "QuickGELU",
    "ReLUSquaredActivation",
    "SiluAndMul",
    "SwigluOAIAndMul",
]

_APPROXIMATIONS = ("none", "tanh")


def _check_approximate(approximate: str) -> None:
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"Unknown approximate mode: {approximate!r}; expected one of "
                         f"{sorted(_APPROXIMATIONS)}")


class _CatalogOpLayer(_OpLayer):
    """A layer whose platform path is its catalog op ``_catalog_op`` applied to ``x`` and to
    the attributes named in ``_op_params`` (in that order), which are also its ``extra_repr``."""

    _catalog_op: ClassVar[Callable[..., Tensor]]
    _op_params: ClassVar[tuple[str, ...]] = ()

    def forward_op(self, x: Tensor) -> Tensor:
        op = type(self)._catalog_op
        if not self._op_params:  # no comprehension frame for the parameterless layers
            return op(x)
        return op(x, *[getattr(self, n) for n in self._op_params])

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={getattr(self, n)!r}" for n in self._op_params)


class _CatalogOpLayerCompileNative(_CatalogOpLayer):
    """A :class:`_CatalogOpLayer` whose vLLM constructor takes ``compile_native`` (ignored)."""

    def __init__(self, *, compile_native: bool = True) -> None:
        super().__init__()


@CustomOp.register("silu_and_mul")
class SiluAndMul(_CatalogOpLayerCompileNative):
    """SwiGLU: ``silu(x[..., :d]) * x[..., d:]`` for ``x[..., 2*d]``."""

    _catalog_op = ops.silu_and_mul

    def forward_native(self, x: Tensor) -> Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


@CustomOp.register("mul_and_silu")
class MulAndSilu(_CatalogOpLayer):
    """``x[..., :d] * silu(x[..., d:])``."""

    _catalog_op = ops.mul_and_silu

    def forward_native(self, x: Tensor) -> Tensor:
        d = x.shape[-1] // 2
        return x[..., :d] * F.silu(x[..., d:])


@CustomOp.register("fatrelu_and_mul")
class FatreluAndMul(_CatalogOpLayer):
    """FATReLU (MiniCPM-S): ``threshold(x[..., :d], threshold, 0) * x[..., d:]``."""

    _catalog_op = ops.fatrelu_and_mul
    _op_params = ("threshold",)

    def __init__(self, threshold: float = 0.0) -> None:
        super().__init__()
        self.threshold = threshold

    def forward_native(self, x: Tensor) -> Tensor:
        d = x.shape[-1] // 2
        return F.threshold(x[..., :d], self.threshold, 0.0) * x[..., d:]


@CustomOp.register("gelu_and_mul")
class GeluAndMul(_CatalogOpLayer):
    """GeGLU: ``gelu(x[..., :d], approximate) * x[..., d:]``.

    :raises ValueError: ``approximate`` not ``"none"``/``"tanh"``.
    """

    _catalog_op = ops.gelu_and_mul
    _op_params = ("approximate",)

    def __init__(self, approximate: str = "none") -> None:
        _check_approximate(approximate)
        super().__init__()
        self.approximate = approximate

    def forward_native(self, x: Tensor) -> Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


@CustomOp.register("gelu_and_mul_sparse")
class GeluAndMulSparse(_CatalogOpLayer):
    """Gemma-3n's GeGLU with a Gaussian top-k gate (see :func:`opmux.ops.gelu_and_mul_sparse`).

    :param activation_sparsity: target fraction of zeroed gate values; ``std_multiplier``
        is its standard-normal quantile (as vLLM computes it).
    :raises ValueError: unknown ``approximate`` or ``activation_sparsity == 0``.
    """

    _catalog_op = ops.gelu_and_mul_sparse
    _op_params = ("activation_sparsity", "approximate")

    def __init__(self, activation_sparsity: float, approximate: str = "none") -> None:
        _check_approximate(approximate)
        if activation_sparsity == 0.0:
            raise ValueError("activation_sparsity is 0.0. Please use GeluAndMul.")
        super().__init__()
        self.approximate = approximate
        self.activation_sparsity = activation_sparsity
        target = torch.tensor(activation_sparsity, dtype=torch.float32)
        self.std_multiplier = torch.distributions.normal.Normal(0, 1).icdf(target).item()

    def forward_native(self, x: Tensor) -> Tensor:
        d = x.shape[-1] // 2
        gate = x[..., :d]
        mean = torch.mean(gate, dim=-1, keepdim=True)
        std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
        sparse = F.relu(gate - (mean + std * self.std_multiplier))
        return F.gelu(sparse, approximate=self.approximate) * x[..., d:]


@CustomOp.register("swigluoai_and_mul")
class SwigluOAIAndMul(_CatalogOpLayer):
    """gpt-oss's clamped SwiGLU on interleaved gate/up (see
    :func:`opmux.ops.swigluoai_and_mul`)."""

    _catalog_op = ops.swigluoai_and_mul
    _op_params = ("alpha", "limit")

    def __init__(self, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.alpha = alpha
        self.limit = limit

    def forward_native(self, x: Tensor) -> Tensor:
        gate = x[..., ::2].clamp(min=None, max=self.limit)
        up = x[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@CustomOp.register("gelu_new")
class NewGELU(_CatalogOpLayer):
    """GPT-2's tanh GELU."""

    _catalog_op = ops.gelu_new

    def forward_native(self, x: Tensor) -> Tensor:
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))


@CustomOp.register("gelu_fast")
class FastGELU(_CatalogOpLayer):
    """The fast tanh GELU."""

    _catalog_op = ops.gelu_fast

    def forward_native(self, x: Tensor) -> Tensor:
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


@CustomOp.register("quick_gelu")
class QuickGELU(_CatalogOpLayer):
    """``x * sigmoid(1.702 x)``."""

    _catalog_op = ops.quick_gelu

    def forward_native(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


@CustomOp.register("relu2")
class ReLUSquaredActivation(_CatalogOpLayerCompileNative):
    """``relu(x)^2`` (Primer)."""

    _catalog_op = ops.relu2

    def forward_native(self, x: Tensor) -> Tensor:
        return torch.square(F.relu(x))


@CustomOp.register("xielu")
class XIELU(_OpLayer):
    """xIELU (arXiv 2411.13010) with vLLM's parameters: ``alpha_p``, ``alpha_n`` (raw,
    pre-softplus, shape [1]) and buffers ``beta``, ``eps``, all in ``dtype``.

    The platform paths pass ``beta``/``eps`` as floats read once at construction (and after
    ``load_state_dict``), so no ``.item()`` reaches a compiled graph. ``with_vector_loads``
    is kept for vLLM's constructor; it tunes vLLM's optional CUDA extension and changes no
    result.
    """

    def __init__(self, alpha_p_init: float = 0.8, alpha_n_init: float = 0.8, beta: float = 0.5,
                 eps: float = -1e-6, dtype: torch.dtype = torch.bfloat16,
                 with_vector_loads: bool = False) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.log(torch.exp(
            torch.tensor(alpha_p_init, dtype=dtype)) - 1).unsqueeze(0))
        self.alpha_n = nn.Parameter(torch.log(torch.exp(
            torch.tensor(alpha_n_init - beta, dtype=dtype)) - 1).unsqueeze(0))
        self.beta: Tensor
        self.eps: Tensor
        self.register_buffer("beta", torch.tensor(beta, dtype=dtype))
        self.register_buffer("eps", torch.tensor(eps, dtype=dtype))
        self.with_vector_loads = with_vector_loads
        self._refresh_scalars()

    def _refresh_scalars(self) -> None:
        self._beta_scalar = float(self.beta.detach().cpu().float().item())
        self._eps_scalar = float(self.eps.detach().cpu().float().item())

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._refresh_scalars()

    def forward_native(self, input: Tensor) -> Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(
            input > 0,
            alpha_p * input * input + self.beta * input,
            (torch.expm1(torch.min(input, self.eps)) - input) * alpha_n + self.beta * input,
        )

    def forward_op(self, input: Tensor) -> Tensor:
        out: Tensor = ops.xielu(input, self.alpha_p, self.alpha_n, self._beta_scalar,
                         self._eps_scalar)
        return out
