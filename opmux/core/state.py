"""The runtime object: the one owner of opmux's process state.

:class:`Runtime` lists every kind of process state as a typed field. Fields of the core
are built with the object; a field owned by a floor above the core (the CustomOp
settings, the KV-cache format table, the tensor-parallel group, ...) starts as ``None``
and is built by its owner on first use, so that ``import opmux`` loads none of those
floors and the core imports none of them (their types are named for type checking
only). The object is built by :func:`opmux._runtime.new_runtime`;
:func:`opmux.testing.reset_for_tests` replaces it with a fresh one after undoing what
lives outside it (see docs/architecture.md, "Process state").

The name tables of that state (layers by name, process groups, CustomOp classes, KV-cache
formats) share one rule, :func:`claim`: a name stays with the first object entered under
it.
"""

from __future__ import annotations

import threading
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from opmux.core.plugins import PluginState
    from opmux.core.registry import OpRegistry
    from opmux.core.tuned import TunedStatus
    from opmux.distributed import TensorParallelGroup
    from opmux.layers.custom_op import CustomOpSettings
    from opmux.ops.kv_formats import FormatTable
    from opmux.platforms.base import Detection, Platform
    from opmux.testing.case_table import CaseGenerator

__all__ = ["Runtime", "claim", "install", "runtime"]

_V = TypeVar("_V")


@dataclass(eq=False)
class Runtime:
    """The process state of opmux (see the module docstring)."""

    #: the process-wide op registry; a reset keeps it (torch cannot undefine an op)
    registry: OpRegistry
    #: the plugin manager, each plugin's record and what it registered
    plugins: PluginState
    #: the platform of this process (``None`` until resolved) and every detector's verdict
    platform: Platform | None = None
    detections: list[Detection] = field(default_factory=list)
    #: the switches: op calls through the torch dispatcher; output checks (``None`` until
    #: first read, then ``OPMUX_CHECK_OUTPUTS`` or code)
    torch_wrap: bool = True
    output_checks: bool | None = None
    #: the last start-up's tuned-table status (``None`` before one)
    tuned: TunedStatus | None = None
    #: ``(file, reason)`` of each cache file a warning already said is ignored
    ignored_files: set[tuple[str, str]] = field(default_factory=set)
    #: process groups by the name the communication ops are given
    process_groups: dict[str, ProcessGroup] = field(default_factory=dict)
    #: the tensor-parallel group (``None``: not initialised, size 1)
    tensor_parallel: TensorParallelGroup | None = None
    #: CustomOp enablement, layer counts and out-of-tree layers (:mod:`opmux.layers`)
    custom_ops: CustomOpSettings | None = None
    #: the registered KV-cache formats and each provider's declaration (:mod:`opmux.ops`)
    kv_formats: FormatTable | None = None
    #: conformance-case generators by op, and whether the catalog's are registered
    case_generators: dict[str, CaseGenerator] = field(default_factory=dict)
    catalog_cases_loaded: bool = False
    #: the layers the vLLM integration replaced (``None`` before it ran in this process)
    vllm_layers: list[str] | None = None
    #: guards the small tables above and the first build of a field; re-entrant, since
    #: building one field may build another
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)


#: the runtime object; a one-element list so that a reset swaps it for every reader
_CURRENT: list[Runtime] = []


def runtime() -> Runtime:
    """This process's runtime object (installed when :mod:`opmux` is imported)."""
    return _CURRENT[0]


def install(rt: Runtime) -> Runtime:
    """Make ``rt`` this process's runtime object and return the one it replaces (if any)."""
    old = _CURRENT[0] if _CURRENT else rt
    _CURRENT[:] = [rt]
    return old


def claim(table: MutableMapping[str, _V], name: str, value: _V) -> _V | None:
    """Enter ``value`` as ``table[name]`` unless another object holds ``name``.

    :returns: ``None`` when ``name`` is now ``value``'s (entered, or already its), else the
        other object that holds it (the table is unchanged; the caller raises its error).
    """
    holder = table.setdefault(name, value)
    return None if holder is value else holder
