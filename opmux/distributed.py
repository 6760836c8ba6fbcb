"""Tensor parallelism on ``torch.distributed``: the named tensor-parallel group.

opmux runs no distributed runtime of its own (DESIGN §9). It uses ``torch.distributed``
process groups started by ``torchrun`` or by the host engine, and gives the
tensor-parallel (TP) group a *name*: the communication ops of
:mod:`opmux.ops.communication` take that name (a string fits a torch schema, a process
group does not) and resolve it when they run, so a compiled graph carries the name as a
constant.

Start under ``torchrun --nproc-per-node 2 script.py``::

    import opmux.distributed as od
    tp = od.init_tensor_parallel()          # RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    tp.rank, tp.world_size, tp.name         # 0|1, 2, "tp"

or adopt a group the engine made: ``od.init_tensor_parallel(group=engine_tp_group)``.
Layers (:mod:`opmux.layers.linear`, ...) read the group when they are built, like vLLM's
``get_tensor_model_parallel_rank()`` / ``..._world_size()``. With nothing initialised the
TP group has size 1 and every collective is a no-op:

>>> import opmux.distributed as od
>>> od.get_tensor_model_parallel_world_size(), od.get_tensor_model_parallel_rank()
(1, 0)
>>> od.divide(4096, 2, "hidden_size")
2048

The group is process state (the ``tensor_parallel`` field of the runtime object,
:class:`opmux.core.state.Runtime`); :func:`destroy_tensor_parallel` returns to the
uninitialised state and destroys the default process group if opmux created it.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from opmux.core.errors import OpmuxError
from opmux.core.state import runtime
from opmux.ops.process_groups import (
    DistributedError,
    forget_groups,
    is_registered,
    register_group,
    resolve_group,
    unregister_group,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "TP_GROUP_NAME",
    "DistributedError",
    "ParallelSizeError",
    "TensorParallelGroup",
    "destroy_tensor_parallel",
    "divide",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_tensor_parallel",
    "is_initialized",
    "register_group",
    "resolve_group",
    "unregister_group",
]

TP_GROUP_NAME: Final = "tp"
"""The default name of the tensor-parallel group (the ``group_name`` layers pass to ops)."""

DEFAULT_BACKENDS: Final[Mapping[str, str]] = {
    "cpu": "gloo", "cuda": "nccl", "rocm": "nccl", "ascend": "hccl", "xla": "xla"}
"""Platform name → torch.distributed backend used when ``backend`` is not given."""

_ENV_REQUIRED: Final = ("RANK", "MASTER_ADDR", "MASTER_PORT")
"""What ``torchrun`` sets besides ``WORLD_SIZE`` and env:// initialisation needs."""


class ParallelSizeError(OpmuxError, ValueError):
    """A size does not divide evenly across the tensor-parallel ranks.

    :ivar what: what was being split (``"QKVParallelLinear total_num_heads"``).
    :ivar numerator: the size.
    :ivar denominator: the number of ranks (or parts).
    """

    def __init__(self, message: str, *, what: str, numerator: int, denominator: int) -> None:
        super().__init__(message)
        self.what = what
        self.numerator = numerator
        self.denominator = denominator


ParallelSizeError.__module__ = "opmux.distributed"


@dataclass(frozen=True)
class TensorParallelGroup:
    """The tensor-parallel group of this process.

    :ivar name: the name ops use to find the group (default ``"tp"``).
    :ivar rank: this process's rank inside the group.
    :ivar world_size: the number of ranks in the group.
    :ivar group: the ``torch.distributed`` process group, ``None`` for size 1 without
        ``torch.distributed``.
    :ivar backend: the backend name (``"gloo"``, ``"nccl"``, ...), ``None`` without a group.
    :ivar owns_process_group: whether opmux initialised the default process group (and
        destroys it in :func:`destroy_tensor_parallel`).
    """

    name: str
    rank: int
    world_size: int
    group: Any = None
    backend: str | None = None
    owns_process_group: bool = False


_SINGLE: Final = TensorParallelGroup(TP_GROUP_NAME, 0, 1)
#: serialises initialisation and destruction (its own lock, not the runtime object's:
#: initialising may wait for the other ranks)
_LOCK = threading.Lock()


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, or a :class:`ParallelSizeError` naming ``what``.

    :param what: what is being split, for the message (``"vocab size"``).
    :raises ParallelSizeError: when ``denominator`` does not divide ``numerator`` (or is
        not positive).
    """
    if denominator < 1 or numerator % denominator:
        raise ParallelSizeError(
            f"{what} = {numerator} is not divisible by the tensor-parallel world size "
            f"{denominator}; choose a world size that divides {numerator}",
            what=what, numerator=numerator, denominator=denominator)
    return numerator // denominator


# --------------------------------------------------------------------- the TP group
def is_initialized() -> bool:
    """Whether :func:`init_tensor_parallel` has run (and no destroy since)."""
    return runtime().tensor_parallel is not None


def get_tp_group() -> TensorParallelGroup:
    """The tensor-parallel group; size 1 (rank 0, no process group) when not initialised."""
    state = runtime().tensor_parallel
    return state if state is not None else _SINGLE


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in the tensor-parallel group (0 when not initialised)."""
    return get_tp_group().rank


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-parallel world size (1 when not initialised)."""
    return get_tp_group().world_size


def init_tensor_parallel(group: ProcessGroup | None = None, *, backend: str | None = None,
                         tensor_parallel_size: int | None = None, name: str = TP_GROUP_NAME,
                         timeout: datetime.timedelta | None = None) -> TensorParallelGroup:
    """Initialise and name the tensor-parallel group.

    * ``group`` given: adopt the engine's process group as the TP group.
    * else, ``torch.distributed`` already initialised: the TP groups are consecutive
      blocks of ``tensor_parallel_size`` ranks of the world (default: the whole world).
    * else, the environment ``torchrun`` sets (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``,
      ``MASTER_PORT``) initialises the default process group (``env://``) with
      ``backend`` (default by platform: gloo on CPU, nccl on CUDA/ROCm, hccl on Ascend,
      xla on XLA; any other backend by name). Without ``WORLD_SIZE`` the process runs
      alone: a TP group of size 1, and ``torch.distributed`` stays untouched.

    :param name: the name the communication ops use (default ``"tp"``).
    :raises DistributedError: already initialised, incomplete environment, or a
        ``tensor_parallel_size`` that does not fit the world.
    """
    import torch.distributed as dist

    with _LOCK:
        rt = runtime()
        if rt.tensor_parallel is not None:
            raise DistributedError(
                f"the tensor-parallel group is already initialised ({rt.tensor_parallel}); call "
                f"opmux.distributed.destroy_tensor_parallel() first")
        if is_registered(name):
            raise DistributedError(f"a process group is already registered as {name!r}")
        owns = False
        if group is None and not (dist.is_available() and dist.is_initialized()):
            if "WORLD_SIZE" not in os.environ:
                state = TensorParallelGroup(name, 0, 1)
                rt.tensor_parallel = state
                return state
            _check_env()
            backend = backend or _default_backend()
            kwargs: dict[str, Any] = {"backend": backend, "init_method": "env://"}
            if timeout is not None:
                kwargs["timeout"] = timeout
            try:
                dist.init_process_group(**kwargs)
            except (RuntimeError, ValueError, OSError) as exc:  # DistStoreError, timeouts
                env = " ".join(f"{v}={os.environ.get(v)}" for v in ("WORLD_SIZE", *_ENV_REQUIRED))
                raise DistributedError(
                    f"torch.distributed could not start ({env}, backend {backend}): "
                    f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; check "
                    f"that every rank runs and reaches MASTER_ADDR:MASTER_PORT, or unset "
                    f"WORLD_SIZE to run alone") from None
            owns = True
        try:
            if group is None:
                group = _split_world(dist, tensor_parallel_size)
            elif tensor_parallel_size is not None and tensor_parallel_size != group.size():
                raise DistributedError(
                    f"tensor_parallel_size={tensor_parallel_size} but the given group has "
                    f"{group.size()} ranks")
        except BaseException:
            if owns:  # leave nothing behind on failure
                dist.destroy_process_group()
            raise
        state = TensorParallelGroup(name, group.rank(), group.size(), group,
                                    dist.get_backend(group), owns)
        register_group(name, group)
        rt.tensor_parallel = state
        return state


def _check_env() -> None:
    """The torchrun variables are present and consistent (a leftover or mistyped
    environment fails here, not after a rendezvous that waits for ranks that never come)."""
    missing = [v for v in _ENV_REQUIRED if v not in os.environ]
    if missing:
        raise DistributedError(
            f"WORLD_SIZE is set but {missing} are not: start the processes with "
            f"torchrun, or set RANK, MASTER_ADDR and MASTER_PORT yourself (or unset "
            f"WORLD_SIZE to run alone)")
    values = {}
    for var, low, high in (("WORLD_SIZE", 1, 1 << 20), ("RANK", 0, 1 << 20),
                           ("MASTER_PORT", 1, 65535)):
        text = os.environ[var].strip()
        if not (text.isascii() and text.isdigit() and low <= int(text) <= high):
            raise DistributedError(
                f"{var}={os.environ[var]!r} in the environment is not an integer in "
                f"{low}..{high}; fix or unset it")
        values[var] = int(text)
    if values["RANK"] >= values["WORLD_SIZE"]:
        raise DistributedError(
            f"RANK={values['RANK']} is not below WORLD_SIZE={values['WORLD_SIZE']} in the "
            f"environment (left over from another run?); fix or unset both")


def _default_backend() -> str:
    from opmux.platforms import current_platform

    return DEFAULT_BACKENDS.get(current_platform().name, "gloo")


def _split_world(dist: Any, tensor_parallel_size: int | None) -> ProcessGroup:
    world = dist.get_world_size()
    size = world if tensor_parallel_size is None else tensor_parallel_size
    if size < 1 or world % size:
        raise DistributedError(
            f"tensor_parallel_size={size} does not divide the world size {world}")
    if size == world:
        return dist.group.WORLD  # type: ignore[no-any-return]
    rank = dist.get_rank()
    mine: ProcessGroup | None = None
    for start in range(0, world, size):  # every rank creates every group, in order
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


def destroy_tensor_parallel() -> None:
    """Forget the TP group; destroy the default process group if opmux created it.

    Safe to call when nothing is initialised. Groups registered with
    :func:`register_group` are forgotten too.
    """
    with _LOCK:
        rt = runtime()
        state, rt.tensor_parallel = rt.tensor_parallel, None
        forget_groups()
    if state is not None and state.owns_process_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
