"""Input checks of the communication ops (:mod:`opmux.ops.communication`): the group a
collective names, and the ``dim`` and sizes of ``all_gather`` and ``reduce_scatter``.

The group is resolved when the op runs (the providers' fakes need its size), so these checks
depend on the process groups known by name (:mod:`opmux.ops.process_groups`).
"""

from __future__ import annotations

from torch import Tensor

from opmux.core.errors import OpInputError, OpmuxError
from opmux.ops.process_groups import resolve_group

__all__ = ["check_all_gather", "check_reduce_scatter", "group_size", "resolve_group_for"]


def resolve_group_for(op: str, provider: str, group_name: str) -> object:
    """The process group called ``group_name`` (``None`` while ``torch.distributed`` is not
    initialised and nothing registered the name), for ``op`` run by ``provider``.

    :raises opmux.OpInputError: ``torch.distributed`` knows no such group.
    """
    try:
        return resolve_group(group_name)
    except OpmuxError as exc:
        raise OpInputError(f"{op} [{provider}]: argument 'group_name': {exc}",
                           op=f"opmux::{op}", provider=provider,
                           argument="group_name") from None


def group_size(group_name: str, op: str = "group_size", provider: str = "native") -> int:
    """The number of ranks of the group called ``group_name`` (1 for an unknown name
    while ``torch.distributed`` is not initialised). Providers and fakes use it.

    :param op: named in the error message, with ``provider``.
    :raises opmux.OpInputError: ``torch.distributed`` is initialised and knows no such group.
    """
    group = resolve_group_for(op, provider, group_name)
    return 1 if group is None else int(group.size())  # type: ignore[attr-defined]


def _check_dim(op: str, provider: str, x: Tensor, dim: int) -> int:
    if x.dim() == 0:
        raise OpInputError(f"{op} [{provider}]: argument 'x': expected a tensor with at least "
                           f"one dimension, got a 0-d tensor", op=f"opmux::{op}",
                           provider=provider, argument="x")
    if not -x.dim() <= dim < x.dim():
        raise OpInputError(f"{op} [{provider}]: argument 'dim': expected a dimension in "
                           f"[{-x.dim()}, {x.dim()}) for shape {tuple(x.shape)}, got {dim}",
                           op=f"opmux::{op}", provider=provider, argument="dim")
    return dim % x.dim()


def check_all_gather(provider: str, x: Tensor, dim: int, group_name: str
                     ) -> tuple[int, list[int]]:
    """Validate an ``all_gather`` call: ``(normalised dim, output shape)``."""
    d = _check_dim("all_gather", provider, x, dim)
    shape = list(x.shape)
    shape[d] *= group_size(group_name, "all_gather", provider)
    return d, shape


def check_reduce_scatter(provider: str, x: Tensor, dim: int, group_name: str
                         ) -> tuple[int, int, list[int]]:
    """Validate a ``reduce_scatter`` call: ``(normalised dim, world size, output shape)``."""
    d = _check_dim("reduce_scatter", provider, x, dim)
    world = group_size(group_name, "reduce_scatter", provider)
    if x.shape[d] % world:
        raise OpInputError(
            f"reduce_scatter [{provider}]: argument 'x': expected dimension {d} (size "
            f"{x.shape[d]}) divisible by the {world} ranks of group {group_name!r}, got shape "
            f"{tuple(x.shape)}", op="opmux::reduce_scatter", provider=provider, argument="x")
    shape = list(x.shape)
    shape[d] //= world
    return d, world, shape
