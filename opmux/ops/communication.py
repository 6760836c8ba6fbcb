"""Communication ops: ``all_reduce``, ``all_gather``, ``reduce_scatter`` over a named group.

Each op takes ``group_name``, the name of a process group registered with
:mod:`opmux.distributed` (``"tp"`` for the tensor-parallel group) or a torch
``ProcessGroup.group_name``; the group is resolved when the op runs. The native
implementation is ``torch.distributed`` (c10d) on that group, registered for every device
(``CompositeExplicitAutograd``), so it serves gloo on CPU, NCCL on CUDA and any backend
torch has. A vendor registers its own collective for its dispatch key (a shared-memory
all-reduce on CPU, a custom all-reduce on CUDA) and wins by priority::

    opmux.ops.all_reduce.register_impl("shm", dispatch_key="CPU")(my_shm_all_reduce)
    opmux.ops.all_reduce.set_default_priority(["shm", "native"])

The ops are functional: the result is a new tensor (contiguous), the input is never
written. ``all_reduce_`` is the in-place variant (declared as mutating ``x``) for callers
that own the tensor, such as the tensor-parallel layers reducing their own fresh partial
outputs: it saves the copy a functional all-reduce must make (a vendor serving both
registers a provider for each). A group of size 1 (or a name nothing knows while
``torch.distributed`` is not initialised) makes every op a copy of its input, and
``all_reduce_`` a no-op. Under ``torch.compile(fullgraph=True)``
each op is one opaque node; its fake only needs the group's size.

Reductions are sums (``tensor_model_parallel_all_reduce`` semantics).
"""

# no ``from __future__ import annotations``: opmux infers the torch schema from these annotations
import torch
import torch.distributed as dist
from torch import Tensor

from opmux.core.errors import OpInputError
from opmux.core.registry import register_op
from opmux.ops.checks.communication import (
    check_all_gather,
    check_reduce_scatter,
    group_size,
    resolve_group_for,
)

__all__ = ["all_gather", "all_reduce", "all_reduce_", "group_size", "reduce_scatter"]


@register_op
def all_reduce(x: Tensor, group_name: str) -> Tensor:
    """Sum of ``x`` over the ranks of group ``group_name``; every rank gets the sum.

    :param x: any dense tensor (same shape and dtype on every rank).
    :param group_name: a group registered with :mod:`opmux.distributed` (e.g. ``"tp"``).
    :returns: a new contiguous tensor of ``x``'s shape and dtype.
    :raises opmux.OpInputError: an unknown group while ``torch.distributed`` is initialised.
    """
    group = resolve_group_for("all_reduce", "native", group_name)
    out = x.clone(memory_format=torch.contiguous_format)
    if group is None or group.size() == 1 or not out.numel():  # type: ignore[attr-defined]
        return out
    dist.all_reduce(out, group=group)  # type: ignore[arg-type]
    return out


@all_reduce.register_meta
def _all_reduce_fake(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@register_op(name="all_reduce_", mutates_args=("x",))
def all_reduce_(x: Tensor, group_name: str) -> None:
    """In-place :func:`all_reduce`: ``x`` becomes the sum over the ranks.

    :param x: a contiguous tensor the caller owns (same shape and dtype on every rank).
    :param group_name: the group (see :func:`all_reduce`).
    :raises opmux.OpInputError: a non-contiguous ``x``, or an unknown group.
    """
    if not x.is_contiguous():
        raise OpInputError(f"all_reduce_ [native]: argument 'x': expected a contiguous "
                           f"tensor (reduced in place), got strides {x.stride()} for shape "
                           f"{tuple(x.shape)}", op="opmux::all_reduce_", provider="native",
                           argument="x")
    group = resolve_group_for("all_reduce_", "native", group_name)
    if group is None or group.size() == 1 or not x.numel():  # type: ignore[attr-defined]
        return
    dist.all_reduce(x, group=group)  # type: ignore[arg-type]


@all_reduce_.register_meta
def _all_reduce_inplace_fake(x: Tensor, group_name: str) -> None:
    return None


@register_op
def all_gather(x: Tensor, dim: int, group_name: str) -> Tensor:
    """Concatenation of every rank's ``x`` along ``dim``, in rank order.

    :param x: a tensor of at least one dimension (same shape and dtype on every rank).
    :param dim: the dimension to concatenate along (negative counts from the end).
    :param group_name: the group (see :func:`all_reduce`).
    :returns: a new contiguous tensor; ``shape[dim]`` is world size times ``x.shape[dim]``.
    :raises opmux.OpInputError: a bad ``dim``, a 0-d ``x``, or an unknown group.
    """
    d, shape = check_all_gather("native", x, dim, group_name)
    group = resolve_group_for("all_gather", "native", group_name)
    if group is None or group.size() == 1:  # type: ignore[attr-defined]
        return x.clone(memory_format=torch.contiguous_format)
    world = group.size()  # type: ignore[attr-defined]
    if not x.numel():
        return x.new_empty(shape)
    # rank blocks stacked along dim 0 (the layout c10d gathers into)
    stacked = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(stacked, x.contiguous(), group=group)  # type: ignore[arg-type]
    if d == 0:
        return stacked
    return stacked.view(world, *x.shape).movedim(0, d).reshape(shape)


@all_gather.register_meta
def _all_gather_fake(x: Tensor, dim: int, group_name: str) -> Tensor:
    _, shape = check_all_gather("fake", x, dim, group_name)
    return x.new_empty(shape)


@register_op
def reduce_scatter(x: Tensor, dim: int, group_name: str) -> Tensor:
    """Sum of ``x`` over the ranks, split along ``dim``; rank ``r`` keeps chunk ``r``.

    :param x: a tensor whose ``dim`` is divisible by the world size.
    :param dim: the dimension to split (negative counts from the end).
    :param group_name: the group (see :func:`all_reduce`).
    :returns: a new contiguous tensor; ``shape[dim]`` is ``x.shape[dim]`` / world size.
    :raises opmux.OpInputError: a bad ``dim``, an indivisible size, or an unknown group.
    """
    d, world, shape = check_reduce_scatter("native", x, dim, group_name)
    group = resolve_group_for("reduce_scatter", "native", group_name)
    if group is None or world == 1:
        return x.clone(memory_format=torch.contiguous_format)
    if not x.numel():
        return x.new_empty(shape)
    moved = x.movedim(d, 0).contiguous()
    out = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=x.dtype,
                      device=x.device)
    dist.reduce_scatter_tensor(out, moved, group=group)  # type: ignore[arg-type]
    return out if d == 0 else out.movedim(0, d).contiguous()


@reduce_scatter.register_meta
def _reduce_scatter_fake(x: Tensor, dim: int, group_name: str) -> Tensor:
    _, _, shape = check_reduce_scatter("fake", x, dim, group_name)
    return x.new_empty(shape)
