"""All of opmux's configuration: every environment variable, read through one function each.

Nothing else in opmux reads ``os.environ`` for its own settings: each variable below has
exactly one accessor here, documented once, in the accessor (docs/configuration.md mirrors
this module); the ``ENV_*`` constants are the variables' names. Accessors
read the environment on every call (cheap; never on the dispatch hot path), so a fixed
configuration takes effect on the next start-up attempt. A malformed value raises
:class:`~opmux.ConfigError` naming the variable and the value.

=============================  =============================  ==============================
variable                       accessor                       meaning
=============================  =============================  ==============================
``OPMUX_PLATFORM``             :func:`platform_override`      force a platform by name
``OPMUX_PRIORITY``             :func:`priority_overrides`     per-op provider order
``OPMUX_PLUGINS``              :func:`plugin_allow_list`      only these plugins load
``OPMUX_STRICT_PLUGINS``       :func:`strict_plugins`         a plugin failure is fatal
``OPMUX_CUSTOM_OPS``           :func:`custom_ops_spec`        CustomOp layer enablement
``OPMUX_COMPILE_MODE``         :func:`compile_mode_spec`      ``inductor``: layers default off
``OPMUX_CHECK_OUTPUTS``        :func:`check_outputs`          check provider outputs (debug)
``OPMUX_CACHE_DIR``            :func:`cache_dir`              native build cache root
``OPMUX_TUNED``                :func:`tuned_enabled`          load the ``opmux tune`` table
``OPMUX_DEBUG``                :func:`debug`                  CLI errors show tracebacks
``OPMUX_ASCEND_SOC_VERSION``   :func:`ascend_soc_version`     AscendC target SoC
``ASCEND_HOME_PATH`` /         :func:`cann_home`              CANN toolkit folder
``ASCEND_TOOLKIT_HOME``
``PJRT_DEVICE``                :func:`pjrt_device`            torch_xla device (xla platform)
``TRITON_INTERPRET``           :func:`triton_interpret`       Triton's CPU interpreter
``CXX``                        :func:`cxx`                    C++ compiler of native builds
``OPMUX_TRACE``                :func:`trace_path`             write provider call counts
``OPMUX_VLLM``                 :func:`vllm_enabled`           ``0``: the vLLM plugin is off
``OPMUX_VLLM_LAYERS``          :func:`vllm_layers`            what the vLLM plugin replaces
=============================  =============================  ==============================
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final

from opmux.core.errors import ConfigError

__all__ = [
    "ENV_ASCEND_SOC_VERSION",
    "ENV_CACHE_DIR",
    "ENV_CHECK_OUTPUTS",
    "ENV_COMPILE_MODE",
    "ENV_CUSTOM_OPS",
    "ENV_DEBUG",
    "ENV_PLATFORM",
    "ENV_PLUGINS",
    "ENV_PRIORITY",
    "ENV_STRICT_PLUGINS",
    "ENV_TUNED",
    "ENV_TRACE",
    "ENV_VLLM",
    "ENV_VLLM_LAYERS",
    "ascend_soc_version",
    "cache_dir",
    "cann_home",
    "check_outputs",
    "compile_mode_spec",
    "custom_ops_spec",
    "cxx",
    "debug",
    "parse_bool",
    "parse_names",
    "parse_plugin_allow_list",
    "parse_priority",
    "pjrt_device",
    "platform_override",
    "plugin_allow_list",
    "priority_overrides",
    "strict_plugins",
    "trace_path",
    "triton_interpret",
    "tuned_enabled",
    "vllm_enabled",
    "vllm_layers",
]

ENV_PLATFORM: Final = "OPMUX_PLATFORM"
ENV_PRIORITY: Final = "OPMUX_PRIORITY"
ENV_PLUGINS: Final = "OPMUX_PLUGINS"
ENV_STRICT_PLUGINS: Final = "OPMUX_STRICT_PLUGINS"
ENV_CUSTOM_OPS: Final = "OPMUX_CUSTOM_OPS"
ENV_COMPILE_MODE: Final = "OPMUX_COMPILE_MODE"
ENV_CHECK_OUTPUTS: Final = "OPMUX_CHECK_OUTPUTS"
ENV_CACHE_DIR: Final = "OPMUX_CACHE_DIR"
ENV_TUNED: Final = "OPMUX_TUNED"
ENV_DEBUG: Final = "OPMUX_DEBUG"
ENV_ASCEND_SOC_VERSION: Final = "OPMUX_ASCEND_SOC_VERSION"
ENV_TRACE: Final = "OPMUX_TRACE"
ENV_VLLM: Final = "OPMUX_VLLM"
ENV_VLLM_LAYERS: Final = "OPMUX_VLLM_LAYERS"

_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"", "0", "false", "no", "off"})
_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")
_OPNAME = re.compile(r"^([a-z_][a-z0-9_]*::)?[a-z_][a-z0-9_]*$")
_PLUGIN_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _env(name: str) -> str | None:
    return os.environ.get(name)


def _text(name: str) -> str:
    """The variable stripped, empty when unset."""
    return (os.environ.get(name) or "").strip()


def _flag(name: str, *, default: bool) -> bool:
    """A boolean variable (:func:`parse_bool`); ``default`` when unset or blank."""
    text = os.environ.get(name)
    return default if text is None or not text.strip() else parse_bool(text, source=name)


# ----------------------------------------------------------------- parsers (pure)
def parse_bool(text: str | None, *, source: str) -> bool:
    """``1/true/yes/on`` → True, ``0/false/no/off`` or unset/empty → False (any case).

    :raises ConfigError: for anything else (``"2"`` is not silently false).
    """
    value = (text or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{source}={text!r} is not a boolean; use 1/true/yes/on or "
                      f"0/false/no/off (or leave it unset)")


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


def parse_names(text: str | None, *, source: str, what: str, pattern: re.Pattern[str],
                example: str) -> frozenset[str] | None:
    """A comma-separated list of names: ``None`` (no restriction) for unset/empty, else the set.

    :raises ConfigError: a value that names nothing (``",,,"``: it would silently select
        nothing) or a name ``pattern`` does not match (``"cpu;cuda"``).
    """
    if text is None or not text.strip():
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not pattern.match(n)]
    if names and not bad:
        return frozenset(names)
    problem = f"bad {what} name(s) {bad}" if bad else f"names no {what} (unset it for all)"
    raise ConfigError(f"{source}={text!r}: {problem}; expected {what} names separated by "
                      f"commas, e.g. {example}")


def parse_plugin_allow_list(text: str | None) -> frozenset[str] | None:
    """``None`` (all allowed) for unset/empty, else the set of plugin names.

    :raises ConfigError: a value that names no plugin at all (``",,,"``: it would
        silently disable every plugin) or a malformed name (``"cpu;cuda"``).
    """
    return parse_names(text, source=ENV_PLUGINS, what="plugin", pattern=_PLUGIN_NAME,
                       example="cpu,cuda")


# --------------------------------------------------------------------- accessors
def platform_override() -> str | None:
    """``OPMUX_PLATFORM``: the forced platform name (``"cuda"``: a built-in or a plugin's),
    or ``None`` (detect)."""
    return _text(ENV_PLATFORM) or None


def priority_overrides() -> dict[str, list[str]]:
    """``OPMUX_PRIORITY`` parsed (``"rms_norm=cpp,native;paged_attention=triton,native"``):
    ``{op: [provider, ...]}`` (empty when unset)."""
    return parse_priority(_env(ENV_PRIORITY) or "")


def priority_text() -> str:
    """``OPMUX_PRIORITY`` as written (for messages)."""
    return _env(ENV_PRIORITY) or ""


def plugin_allow_list() -> frozenset[str] | None:
    """``OPMUX_PLUGINS`` parsed (``"cpu,cuda"``): the allowed plugin names, or ``None``
    (unset or empty: all)."""
    return parse_plugin_allow_list(_env(ENV_PLUGINS))


def strict_plugins() -> bool:
    """``OPMUX_STRICT_PLUGINS``: whether a plugin failure raises instead of being recorded
    and skipped (unset: no)."""
    return _flag(ENV_STRICT_PLUGINS, default=False)


def custom_ops_spec() -> str:
    """``OPMUX_CUSTOM_OPS`` as written (``"all,-rms_norm"`` / ``"none,+rms_norm"``: which
    CustomOp layers use their platform path; empty when unset); see :func:`parse_custom_ops`."""
    return _env(ENV_CUSTOM_OPS) or ""


def compile_mode_spec() -> str:
    """``OPMUX_COMPILE_MODE``, stripped and lower-cased (empty when unset): ``inductor``,
    ``none`` or the name of a registered ``torch.compile`` backend.

    :raises ConfigError: any other name (a typo such as ``indcutor``), with the choices.
    """
    value = _text(ENV_COMPILE_MODE).lower()
    if value in ("", "inductor", "none"):
        return value
    import torch  # only for a name that is not one of ours

    backends = set(torch.compiler.list_backends(exclude_tags=()))
    if value not in backends:
        import difflib

        close = difflib.get_close_matches(value, sorted({"inductor", "none", *backends}), 1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{ENV_COMPILE_MODE}: expected 'inductor', 'none' or a registered "
                          f"torch.compile backend name, got {value!r}{hint}; registered: "
                          f"{', '.join(sorted(backends))}")
    return value


def check_outputs() -> bool:
    """``OPMUX_CHECK_OUTPUTS``: whether every provider's outputs are checked against the op's
    fake and its inputs for mutation (a debug mode; unset: no)."""
    return _flag(ENV_CHECK_OUTPUTS, default=False)


def cache_dir() -> Path:
    """``OPMUX_CACHE_DIR`` (``~`` expanded): root folder of the native build caches, the tuned
    tables, the compiled dispatch functions and the plugins' entry points; default
    ``~/.cache/opmux``."""
    value = _text(ENV_CACHE_DIR)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "opmux"


def tuned_enabled() -> bool:
    """``OPMUX_TUNED``: whether start-up loads the table ``opmux tune`` wrote (unset: yes;
    ``0``/``false``: ignore it)."""
    return _flag(ENV_TUNED, default=True)


def debug() -> bool:
    """``OPMUX_DEBUG``: whether the ``opmux`` CLI re-raises errors with their traceback (any
    non-false value)."""
    return _text(ENV_DEBUG).lower() not in _FALSE


def ascend_soc_version() -> str:
    """``OPMUX_ASCEND_SOC_VERSION``: the Ascend SoC the AscendC kernels are compiled for,
    default ``"Ascend910B1"``."""
    return _text(ENV_ASCEND_SOC_VERSION) or "Ascend910B1"


def cann_home() -> Path | None:
    """The CANN toolkit folder from ``ASCEND_HOME_PATH`` / ``ASCEND_TOOLKIT_HOME``, if it exists."""
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        value = _env(var)
        if value and os.path.isdir(value):
            return Path(value)
    return None


def pjrt_device() -> str | None:
    """``PJRT_DEVICE`` (torch_xla's device selector), or ``None`` when unset/empty."""
    return _env("PJRT_DEVICE") or None


def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: whether Triton runs kernels in its CPU interpreter."""
    return _text("TRITON_INTERPRET").lower() in _TRUE


def cxx(default: str = "c++") -> str:
    """``CXX``: the C++ compiler native builds use (``default`` when unset)."""
    return _env("CXX") or default


def trace_path() -> str | None:
    """``OPMUX_TRACE``: the trace file pattern (``"/tmp/trace-{pid}.json"``, ``{pid}`` not yet
    expanded, ``~`` expanded as in ``OPMUX_CACHE_DIR``; each process writes
    ``{op: {provider: calls}}`` there at exit), or ``None``."""
    value = _text(ENV_TRACE)
    return os.path.expanduser(value) if value else None


def vllm_enabled() -> bool:
    """``OPMUX_VLLM``: whether the vLLM plugin replaces anything (unset: yes; ``0``/``false``:
    it registers nothing).

    :raises ConfigError: a value that is not a boolean.
    """
    return _flag(ENV_VLLM, default=True)


def vllm_layers() -> frozenset[str] | None:
    """``OPMUX_VLLM_LAYERS`` parsed (``"rms_norm,silu_and_mul,attention"``): the names to
    replace, or ``None`` (everything).

    Names are checked against the plugin's table by :func:`opmux.integrations.vllm.register`.

    :raises ConfigError: a value that names nothing (``",,"``) or a malformed name.
    """
    return parse_names(_env(ENV_VLLM_LAYERS), source=ENV_VLLM_LAYERS, what="layer",
                       pattern=_IDENT, example="rms_norm,silu_and_mul,attention")
