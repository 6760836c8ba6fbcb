"""Input checks of the dense linear op (:mod:`opmux.ops.linear`).

Same contract as every module of :mod:`opmux.ops.checks`: ``check_linear`` takes the op's
arguments (same names and order) plus ``provider`` (named in the error) and ``read_data``
(unused here: no index arguments), and raises :class:`opmux.OpInputError` before anything is
computed.
"""

from __future__ import annotations

from torch import Tensor

from opmux.ops.checks.input_errors import input_error, shape_text
from opmux.ops.checks.single_arguments import check_devices, check_float_tensor
from opmux.ops.checks.symbolic import require

__all__ = ["check_linear"]


def check_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                 provider: str = "native", read_data: bool = True) -> None:
    """Validate ``linear(x, weight, bias)``: a floating ``x[..., in]``, ``weight[out, in]``
    and ``bias[out]`` (or ``None``) of x's dtype, all on x's device."""
    op = "linear"
    x = check_float_tensor(op, provider, "x", x)
    weight = check_float_tensor(op, provider, "weight", weight)
    if x.dim() < 1:
        raise input_error(op, provider, "x", "a tensor [..., in] with at least one dimension",
                          shape_text(x))
    if weight.dim() != 2:
        raise input_error(op, provider, "weight", "a 2-d tensor [out, in]", shape_text(weight))
    if weight.dtype != x.dtype:
        raise input_error(op, provider, "weight", f"x's dtype {x.dtype}", weight.dtype)
    k = x.shape[-1]
    require(weight.shape[1] == k, op, provider, "weight",
            lambda: f"shape [out, {k}] (x's last dimension)", lambda: shape_text(weight))
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        b = check_float_tensor(op, provider, "bias", bias)
        if b.dim() != 1:
            raise input_error(op, provider, "bias", "a 1-d tensor [out] or None", shape_text(b))
        if b.dtype != x.dtype:
            raise input_error(op, provider, "bias", f"x's dtype {x.dtype}", b.dtype)
        n = weight.shape[0]
        require(b.shape[0] == n, op, provider, "bias",
                lambda: f"shape [{n}] (weight's rows)", lambda: shape_text(b))
        tensors["bias"] = b
    check_devices(op, provider, tensors)
