"""Parsing of opmux's configuration strings (environment variables and API arguments)."""

from __future__ import annotations

import os
import re

from opmux.core.errors import ConfigError

__all__ = ["ENV_CUSTOM_OPS", "ENV_PLUGINS", "ENV_PRIORITY", "ENV_STRICT_PLUGINS",
           "parse_custom_ops", "parse_plugin_allow_list", "parse_priority", "strict_plugins"]

ENV_PRIORITY = "OPMUX_PRIORITY"
"""``"rms_norm=cpp,native;paged_attention=triton,native"``: per-op provider order."""
ENV_PLUGINS = "OPMUX_PLUGINS"
"""``"cpu,cuda"``: only these plugins load (unset: all)."""
ENV_STRICT_PLUGINS = "OPMUX_STRICT_PLUGINS"
"""``1``: a plugin failure raises instead of being recorded and skipped."""
ENV_CUSTOM_OPS = "OPMUX_CUSTOM_OPS"
"""``"all,-rms_norm"`` / ``"none,+rms_norm"``: which CustomOp layers use their platform path."""

_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")
_OPNAME = re.compile(r"^([a-z_][a-z0-9_]*::)?[a-z_][a-z0-9_]*$")


def parse_priority(text: str, *, source: str = ENV_PRIORITY) -> dict[str, list[str]]:
    """Parse ``"op=a,b;op2=c"`` into ``{"op": ["a", "b"], "op2": ["c"]}``.

    :raises ConfigError: naming the malformed part.
    """
    result: dict[str, list[str]] = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        if part.count("=") != 1:
            raise ConfigError(f"{source}: part {part!r} is not of the form op=provider,provider")
        op, _, providers = (s.strip() for s in part.partition("="))
        if not _OPNAME.match(op):
            raise ConfigError(f"{source}: part {part!r}: {op!r} is not an op name")
        names = [p.strip() for p in providers.split(",")]
        bad = [p for p in names if not _IDENT.match(p)]
        if not providers.strip() or bad:
            raise ConfigError(f"{source}: part {part!r}: bad provider name(s) {bad or ['']}")
        if op in result:
            raise ConfigError(f"{source}: op {op!r} is given twice")
        result[op] = names
    return result


def parse_plugin_allow_list(text: str | None) -> frozenset[str] | None:
    """``None`` (all allowed) for unset/empty, else the set of plugin names."""
    if text is None or not text.strip():
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not re.match(r"^[A-Za-z0-9_.\-]+$", n)]
    if bad:
        raise ConfigError(f"{ENV_PLUGINS}: bad plugin name(s) {bad}; expected a,b,c")
    return frozenset(names)


def strict_plugins() -> bool:
    """Whether ``OPMUX_STRICT_PLUGINS`` asks for plugin failures to be fatal."""
    return os.environ.get(ENV_STRICT_PLUGINS, "").strip().lower() in ("1", "true", "yes", "on")


def parse_custom_ops(text: str, *, source: str = "custom ops") -> tuple[bool, dict[str, bool]]:
    """Parse ``"all,-rms_norm"`` / ``"none,+silu_and_mul"``.

    :returns: ``(default_enabled, {name: enabled})``. Without ``all``/``none`` the default
        is enabled.
    :raises ConfigError: both ``all`` and ``none``, a repeated base, or an element that is
        not ``all``, ``none``, ``+name`` or ``-name``.
    """
    default: bool | None = None
    overrides: dict[str, bool] = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        if item in ("all", "none"):
            if default is not None:
                raise ConfigError(
                    f"{source}: {text!r} gives 'all'/'none' more than once; use exactly one")
            default = item == "all"
        elif item[0] in "+-" and _IDENT.match(item[1:]):
            overrides[item[1:]] = item[0] == "+"
        else:
            raise ConfigError(
                f"{source}: element {item!r} of {text!r} is not 'all', 'none', '+name' or '-name'")
    return (True if default is None else default), overrides
