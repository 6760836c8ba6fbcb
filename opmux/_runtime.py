"""Start-up wiring: builds the runtime object and brings a process up.

:func:`_start` is the start-up sequence, read top to bottom; docs/architecture.md
("Start-up") describes each step, what it reads and when it runs. Only a completed
start-up marks the registry loaded, so a fatal error is raised again by every op call
until the configuration is fixed.

This module sits above the floors it wires (core, platforms, ops), so none of them
imports it: the process-wide registry gets the start-up and the catalog import as its
``loader`` and ``catalog`` arguments, and the current platform's key as its
``platform_key``. :func:`new_runtime` builds the runtime object
(:class:`opmux.core.state.Runtime`); importing this module installs the first one.
"""

from __future__ import annotations

from opmux.core import plugins
from opmux.core.plugins import PluginRecord, PluginState, plugin_report, plugin_state
from opmux.core.registry import OpRegistry, global_registry
from opmux.core.state import Runtime, install
from opmux.platforms import current_platform

__all__ = ["load_plugins", "new_runtime"]


def _load_catalog() -> None:
    """Import the op catalog (its modules register into the global registry). Python's
    import system makes this once per process, and a catalog module registering an op
    (which asks for the catalog again) gets the module being imported."""
    import opmux.ops  # noqa: F401


def _start(registry: OpRegistry) -> None:
    """The start-up sequence (docs/architecture.md, "Start-up"), for ``registry``.

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


def new_runtime(registry: OpRegistry) -> Runtime:
    """A fresh runtime object around ``registry``: no plugin loaded, no platform resolved."""
    return Runtime(registry=registry, plugins=PluginState())


install(new_runtime(OpRegistry(loader=_start, catalog=_load_catalog,
                               platform_key=_platform_key)))


def load_plugins(registry: OpRegistry | None = None) -> list[PluginRecord]:
    """Run start-up now (idempotent, thread-safe) and return the plugin report.

    :param registry: run the start-up sequence for this registry instead of the
        process-wide one (tests: a fresh registry served by the process's plugins). Each
        call composes its priorities again; the plugins are discovered and activated once
        per runtime object.
    :raises OpmuxError: the fatal errors of start-up (an unknown ``OPMUX_PLATFORM``, two
        platforms claiming the machine, a malformed ``OPMUX_*`` variable, a failing plugin
        in strict mode), on every call until fixed.
    """
    if registry is None:
        global_registry().ensure_loaded()
    else:
        _start(registry)
    return plugin_report()
