"""What the tensor-parallel layers share: the TP coordinates, weight attributes, checked copies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from opmux.core.errors import ConfigError, OpInputError
from opmux.distributed import get_tp_group

__all__ = ["copy_checked", "load_rank_slice", "narrow_full", "new_param", "reject_quant_config",
           "set_weight_attrs", "tp_coords"]


def tp_coords(disable_tp: bool) -> tuple[int, int, str]:
    """``(rank, world size, group name)`` of the TP group, or ``(0, 1, name)`` if disabled."""
    group = get_tp_group()
    if disable_tp:
        return 0, 1, group.name
    return group.rank, group.world_size, group.name


def reject_quant_config(layer: str, quant_config: object) -> None:
    """opmux layers are unquantized: a quantization config is an error, not ignored."""
    if quant_config is not None:
        raise ConfigError(f"{layer}: quant_config={quant_config!r} is not supported (opmux "
                          f"layers hold unquantized weights); pass quant_config=None")


def set_weight_attrs(param: torch.nn.Parameter, attrs: dict[str, Any]) -> None:
    """Attach loader metadata to a parameter as vLLM does (``output_dim``,
    ``input_dim``, ``weight_loader``), so model loaders call
    ``param.weight_loader(param, full_tensor[, shard_id])``."""
    for key, value in attrs.items():
        setattr(param, key, value)


def new_param(dtype: torch.dtype, weight_loader: Callable[..., None], *shape: int,
              **attrs: Any) -> torch.nn.Parameter:
    """An uninitialised frozen parameter ``[*shape]`` carrying ``attrs`` and ``weight_loader``."""
    param = torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, {**attrs, "weight_loader": weight_loader})
    return param


def narrow_full(layer: str, loaded: torch.Tensor, dim: int, full: int, start: int,
                length: int, what: str = "loaded_weight") -> torch.Tensor:
    """Check that ``loaded`` is the full checkpoint tensor along ``dim`` (size ``full``)
    and return its ``[start, start + length)`` slice there.

    :raises OpInputError: ``loaded`` has another size along ``dim`` (e.g. a shard was
        passed where the full tensor is expected).
    """
    if loaded.dim() <= dim or loaded.shape[dim] != full:
        raise OpInputError(
            f"{layer}.weight_loader: argument {what!r}: expected the full checkpoint tensor "
            f"with size {full} along dimension {dim}, got shape {tuple(loaded.shape)}",
            op=layer, argument=what)
    return loaded.narrow(dim, start, length)


def copy_checked(layer: str, dst: torch.Tensor, loaded: torch.Tensor) -> None:
    """``dst.copy_(loaded)`` after checking shapes (0-d checkpoint scalars fill 1-element
    parameters).

    :raises OpInputError: the shapes differ.
    """
    if loaded.dim() == 0 and dst.numel() == 1:
        loaded = loaded.reshape(dst.shape)
    if tuple(dst.shape) != tuple(loaded.shape):
        raise OpInputError(
            f"{layer}.weight_loader: argument 'loaded_weight': expected shape "
            f"{tuple(dst.shape)} for this rank's parameter, got {tuple(loaded.shape)}",
            op=layer, argument="loaded_weight")
    with torch.no_grad():
        dst.copy_(loaded)


def load_rank_slice(layer: str, param: torch.Tensor, loaded: torch.Tensor, dim: int | None,
                    rank: int, world: int) -> None:
    """Copy rank ``rank``'s equal slice along ``dim`` of the full checkpoint tensor
    ``loaded`` into ``param`` (``dim`` None: copy it whole)."""
    if dim is not None:
        size = param.shape[dim]
        loaded = narrow_full(layer, loaded, dim, size * world, rank * size, size)
    copy_checked(layer, param.data, loaded)
