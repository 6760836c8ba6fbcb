"""Entry module of the example vendor plugin: hooks only, heavy work deferred.

Declared in this package's ``pyproject.toml``::

    [project.entry-points."opmux.plugins"]
    example_vendor = "opmux_example_vendor.plugin"
"""

from __future__ import annotations

import os
from typing import Any

import opmux

#: Setting this variable to 1 makes the example platform claim the machine.
PLATFORM_ENV = "OPMUX_EXAMPLE_PLATFORM"

#: The ops this plugin serves, by the name the priority hook is asked about.
SERVED = ("rms_norm", "silu_and_mul", "example_vendor::softcap")


class ExampleAccelPlatform(opmux.Platform):
    """An out-of-tree platform. Its "device" is the host CPU, so it runs anywhere.

    Its layers run ``forward_example_accel`` where a layer defines one, and their
    catalog-op path otherwise, whose ops dispatch to this plugin's providers.
    """

    name = "example_accel"
    device_type = "cpu"
    dispatch_key = "CPU"
    forward_method = "forward_example_accel"

    @classmethod
    def is_available(cls) -> bool:
        return os.environ.get(PLATFORM_ENV) == "1"

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["vendor"] = "opmux-example-vendor"
        return info


@opmux.hookimpl
def opmux_plugin_info() -> dict[str, Any]:
    return {"name": "example_vendor", "platforms": ["cpu", "example_accel"]}


@opmux.hookimpl
def opmux_platforms() -> list[type[opmux.Platform]]:
    return [ExampleAccelPlatform]


@opmux.hookimpl
def opmux_register(registry: Any, platform: opmux.Platform) -> None:
    from opmux_example_vendor import kernels  # the "heavy" part, imported only when active

    kernels.register(registry)


@opmux.hookimpl
def opmux_default_priority(op_name: str, platform: opmux.Platform) -> list[str] | None:
    # On its own platform the vendor goes first; on a plain CPU platform it expresses no
    # preference, so the built-in C++ provider stays first there.
    if platform.name == ExampleAccelPlatform.name and op_name in SERVED:
        return ["example_vendor", "native"]
    return None
