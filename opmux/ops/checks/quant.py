"""Input checks of the quantisation op (:mod:`opmux.ops.quant`): ``quant_fp8``.

Same contract as every module of :mod:`opmux.ops.checks`: ``check_quant_fp8`` takes the op's
arguments plus ``provider`` and ``read_data`` (unused: no index arguments) and raises
:class:`opmux.OpInputError` before anything is written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from opmux.ops.checks.input_errors import input_error
from opmux.ops.checks.single_arguments import check_float_tensor, check_same_device, check_tensor

__all__ = ["check_quant_fp8"]


def _static_scale(op: str, provider: str, x: Tensor, scale: Tensor) -> None:
    scale = check_float_tensor(op, provider, "scale", scale)
    check_same_device(op, provider, x, scale=scale)
    if scale.numel() == 1 and scale.dim() <= (2 if x.dim() >= 2 else 1):
        return
    rows, cols = (int(x.shape[-2]), int(x.shape[-1])) if x.dim() >= 2 else (0, 0)
    if (x.dim() < 2 or scale.dim() != 2 or scale.shape[0] == 0 or scale.shape[1] == 0
            or rows % scale.shape[0] != 0 or cols % scale.shape[1] != 0):
        raise input_error(op, provider, "scale",
                          "a one-element tensor (per-tensor) or a 2-d tensor [a, b] with a "
                          f"dividing x's rows ({rows}) and b dividing x's columns ({cols})",
                          f"shape {list(scale.shape)} for x of shape {list(x.shape)}")


def check_quant_fp8(x: Tensor, scale: Tensor | None = None, per_token: bool = False,
                    scale_ub: Tensor | None = None, group_size: int | None = None,
                    use_ue8m0: bool = False, *, provider: str = "native",
                    read_data: bool = True) -> None:
    """Validate ``quant_fp8(x, scale, per_token, scale_ub, group_size, use_ue8m0)``.

    Exactly one mode: static (``scale`` given), dynamic per-tensor (default), dynamic
    per-token (``per_token``, optionally ``scale_ub``) or dynamic per-group (``group_size``,
    optionally ``use_ue8m0``).
    """
    op = "quant_fp8"
    x = check_float_tensor(op, provider, "x", x)
    if x.dim() < 1:
        raise input_error(op, provider, "x", "a tensor [..., N] with at least one dimension",
                          f"shape {list(x.shape)}")
    if scale is not None:
        for name, bad in (("per_token", per_token), ("scale_ub", scale_ub is not None),
                          ("group_size", group_size is not None), ("use_ue8m0", use_ue8m0)):
            if bad:
                raise input_error(op, provider, name, "its default with a static scale "
                                  "(it selects a dynamic mode)", "a non-default value")
        _static_scale(op, provider, x, scale)
        return
    if x.shape[-1] == 0 or (not per_token and group_size is None and x.numel() == 0):
        raise input_error(op, provider, "x", "a non-empty last dimension (and a non-empty "
                          "tensor for a per-tensor scale): a dynamic scale reads its maximum",
                          f"shape {list(x.shape)}")
    if group_size is not None:
        if group_size <= 0:
            raise input_error(op, provider, "group_size", "None or a positive int", group_size)
        if per_token:
            raise input_error(op, provider, "per_token", "False with group_size (groups are "
                              "per token already)", per_token)
        if scale_ub is not None:
            raise input_error(op, provider, "scale_ub", "None with group_size (it bounds "
                              "per-token scales)", "a tensor")
        return
    if use_ue8m0:
        raise input_error(op, provider, "use_ue8m0", "False without group_size (power-of-two "
                          "scales are a per-group option)", use_ue8m0)
    if scale_ub is not None:
        if not per_token:
            raise input_error(op, provider, "scale_ub", "None unless per_token (it bounds "
                              "per-token scales)", "a tensor")
        scale_ub = check_tensor(op, provider, "scale_ub", scale_ub)
        if scale_ub.dtype != torch.float32 or scale_ub.numel() != 1 or scale_ub.dim() > 1:
            raise input_error(op, provider, "scale_ub", "a one-element float32 tensor of shape "
                              "[] or [1]", f"{scale_ub.dtype} tensor of shape "
                              f"{list(scale_ub.shape)}")
        check_same_device(op, provider, x, scale_ub=scale_ub)
