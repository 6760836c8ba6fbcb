"""Process groups by name: how the communication ops find the group a call names.

:mod:`opmux.distributed` registers the tensor-parallel group here (and re-exports these
functions); a host engine may register its own groups. This table sits with the ops,
below :mod:`opmux.distributed`, because the ops read it when a collective runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opmux.core.errors import OpmuxError
from opmux.core.state import claim, runtime

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DistributedError", "forget_groups", "is_registered", "register_group", "resolve_group",
           "unregister_group"]


class DistributedError(OpmuxError, RuntimeError):
    """Setting up or using the tensor-parallel group failed (environment, state, backend)."""


DistributedError.__module__ = "opmux.distributed"


def _groups() -> dict[str, ProcessGroup]:
    """Name → process group (the runtime object's table), read by the ops when they run."""
    return runtime().process_groups


def register_group(name: str, group: ProcessGroup) -> None:
    """Make ``group`` reachable by the communication ops as ``group_name=name``.

    :raises DistributedError: when ``name`` is taken by another group.
    """
    with runtime().lock:
        if claim(_groups(), name, group) is not None:
            raise DistributedError(
                f"a process group is already registered as {name!r}; unregister_group("
                f"{name!r}) first or choose another name")


def unregister_group(name: str) -> None:
    """Forget the group registered as ``name`` (no error when there is none)."""
    with runtime().lock:
        _groups().pop(name, None)


def resolve_group(name: str) -> ProcessGroup | None:
    """The process group called ``name``, or ``None`` when it is a group of size 1.

    Looks in opmux's names first, then in torch's own (``ProcessGroup.group_name``).
    A name that nothing knows is a size-1 group while ``torch.distributed`` is not
    initialised (single-process runs need no set-up).

    :raises DistributedError: ``torch.distributed`` is initialised but knows no such
        group; the message lists opmux's names.
    """
    groups = _groups()
    group = groups.get(name)
    if group is not None:
        return group
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type,attr-defined,no-any-return]
    except (RuntimeError, ValueError, KeyError) as exc:
        raise DistributedError(
            f"no process group named {name!r}: opmux knows {sorted(groups)} and torch "
            f"has none of that name ({exc}); call opmux.distributed.init_tensor_parallel() "
            f"or register_group({name!r}, group)") from None


def is_registered(name: str) -> bool:
    """Whether a group is registered as ``name``."""
    return name in _groups()


def forget_groups() -> None:
    """Forget every registered group (:func:`opmux.distributed.destroy_tensor_parallel`)."""
    with runtime().lock:
        _groups().clear()
