"""Start-up wiring: builds the process-wide registry and brings a process up.

:func:`_start` is the sequence, read top to bottom: discover the plugins, detect the
platform, load the catalog, let the plugins register, compose the priorities. It runs
lazily, on the first op call of the process (or :func:`load_plugins`), in spawned workers
too. docs/architecture.md ("Start-up") describes each step and what it reads.

Only a completed start-up marks the registry loaded, so a fatal error (an unknown
``OPMUX_PLATFORM``, two platforms claiming the machine, a malformed
``OPMUX_PLUGINS``/``OPMUX_PRIORITY``/``OPMUX_STRICT_PLUGINS``, a failing plugin in strict
mode) is raised again by every op call until the configuration is fixed.

This module sits above every floor it wires (core, platforms, ops), so none of them
imports it: the registry (:mod:`opmux.core.registry`) gets the start-up and the catalog
import as its ``loader`` and ``catalog`` hooks. The registry is held by the runtime object
(:mod:`opmux.core.state`); :func:`reset_for_tests` replaces that object, after undoing what
plugins registered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from opmux.core import plugins
from opmux.core.plugins import PluginRecord, plugin_report, plugin_state
from opmux.core.registry import DEFAULT_NAMESPACE, OpRegistry, global_registry
from opmux.core.state import register_reset, reset_for_tests, runtime
from opmux.core.torch_lib import define_custom_op, validate_name
from opmux.platforms import current_platform

__all__ = ["direct_register_custom_op", "load_plugins", "reset_for_tests"]

def _load_catalog() -> None:
    """Import the op catalog (its modules register into the global registry). Python's
    import system makes this once per process, and a catalog module registering an op
    (which asks for the catalog again) gets the module being imported."""
    import opmux.ops  # noqa: F401


def _start(registry: OpRegistry) -> None:
    """The start-up sequence of the module docstring, for ``registry``.

    :raises ConfigError: a malformed ``OPMUX_*`` variable.
    :raises PlatformError: ``OPMUX_PLATFORM`` unknown, or several platforms claim.
    :raises PluginLoadError: a plugin failed and ``OPMUX_STRICT_PLUGINS`` is on.
    """
    state = plugin_state()
    with state.lock:
        plugins.discover(state)                             # 1. entry modules, info, platforms
        platform = current_platform()                       # 2. detectors + plugins' platforms
        _load_catalog()                                     # 3. the native reference ops
        plugins.activate(state, registry, platform)         # 4. opmux_register, priorities asked
        plugins.check_strict(state)
        plugins.apply_priorities(state, registry, platform)  # 5. the priority layers


def _platform_key() -> str:
    return current_platform().dispatch_key


runtime().install(OpRegistry(loader=_start, catalog=_load_catalog, platform_key=_platform_key))


def load_plugins() -> list[PluginRecord]:
    """Run start-up now (idempotent, thread-safe) and return the plugin report.

    :raises OpmuxError: the fatal errors of start-up (see the module docstring), on every
        call until fixed.
    """
    global_registry().ensure_loaded()
    return plugin_report()


def direct_register_custom_op(
    op_name: str,
    op_func: Callable[..., Any],
    mutates_args: Sequence[str] | None = None,
    fake_impl: Callable[..., Any] | None = None,
    target_lib: torch.library.Library | None = None,
    dispatch_key: str | None = None,
    tags: Sequence[torch.Tag] = (),
) -> None:
    """Register ``op_func`` as a torch op with the least overhead: define + one impl.

    The engine-style helper: the schema is inferred from ``op_func``, the op is defined
    in ``target_lib`` (default: opmux's own ``opmux`` library, kept alive by the global
    registry) and ``op_func`` becomes the kernel for ``dispatch_key`` (default: the
    current platform's key). ``fake_impl`` gives shapes for ``torch.compile``. Everything
    is validated before the op is defined: a refused call leaves nothing behind and a
    corrected retry works. Catalog op names are reserved in namespace ``opmux``.

    :param op_name: name inside the library's namespace, e.g. ``"my_attention"``.
    :param mutates_args: names of the Tensor arguments written in place.
    :raises RegistrationError: a bad name, torch's own namespace, an unknown dispatch
        key, or a name already defined (catalog names included).
    """
    registry = global_registry()
    lib = target_lib if target_lib is not None else registry.library(DEFAULT_NAMESPACE)
    if lib.ns == DEFAULT_NAMESPACE:
        validate_name("op", op_name)
        _load_catalog()
        registry.check_undefined(lib.ns, op_name)
    key = dispatch_key if dispatch_key is not None else current_platform().dispatch_key
    define_custom_op(lib, op_name, op_func, key, mutates_args=mutates_args,
                     fake_impl=fake_impl, tags=tags)


@register_reset
def _reset_global_registry() -> None:
    """Undo start-up: plugins' providers leave, priorities clear, start-up runs again.

    Ops stay defined (torch cannot undefine one op of a shared library), catalog and
    plugin-defined ones included; only what plugins registered on them is rolled back.
    """
    registry = global_registry()
    state = plugin_state()
    with state.lock:
        for journal in state.journals.values():
            registry.rollback(*journal, forget_ops=False)
        for op in registry.known_ops():
            op.priorities.reset()
        registry.unload()
