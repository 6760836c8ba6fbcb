"""The exceptions opmux raises.

Every error derives from :class:`OpmuxError` and from the builtin that matches its
meaning (``ValueError`` for bad values, ``TypeError`` for bad signatures, ...), so
callers can catch either. Messages say what happened, where, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "BuildError",
    "ConfigError",
    "OpInputError",
    "OpmuxError",
    "PlatformError",
    "PluginLoadError",
    "ProviderOutputError",
    "ProviderUnavailableError",
    "RegistrationError",
    "SignatureMismatchError",
    "UnknownOpError",
    "UnknownRunnerError",
]


class OpmuxError(Exception):
    """Base class of every error opmux raises."""


class RegistrationError(OpmuxError, ValueError):
    """An op or provider could not be registered (bad name, duplicate, reserved, bad key).

    :ivar op: qualified name of the op involved, when known.
    :ivar provider: provider name involved, when known.
    """

    def __init__(self, message: str, *, op: str | None = None, provider: str | None = None):
        super().__init__(message)
        self.op = op
        self.provider = provider


class SignatureMismatchError(OpmuxError, TypeError):
    """A provider or predicate signature does not match the native signature."""

    def __init__(self, message: str, *, op: str | None = None, provider: str | None = None):
        super().__init__(message)
        self.op = op
        self.provider = provider


class UnknownOpError(OpmuxError, KeyError):
    """No op of that name is registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class ConfigError(OpmuxError, ValueError):
    """A configuration string (env var or API argument) is malformed or names unknown things."""


class OpInputError(OpmuxError, ValueError):
    """An op was called with arguments it cannot take (dtype, shape, range, contiguity).

    :ivar op: the op, when known (``"opmux::rms_norm"``).
    :ivar provider: the provider that refused the call, when known.
    :ivar argument: the offending argument's name, when known.
    """

    def __init__(self, message: str, *, op: str | None = None, provider: str | None = None,
                 argument: str | None = None):
        super().__init__(message)
        self.op = op
        self.provider = provider
        self.argument = argument


class ProviderUnavailableError(OpmuxError, RuntimeError):
    """A provider was asked for but cannot run here (not supported, not built)."""


class ProviderOutputError(OpmuxError, RuntimeError):
    """A provider broke its contract on a call (wrong output metadata, or it changed an
    input it does not declare in ``mutates_args``); raised only while output checks are on.

    :ivar op: qualified name of the op.
    :ivar provider: the provider that misbehaved.
    """

    def __init__(self, message: str, *, op: str, provider: str):
        super().__init__(message)
        self.op = op
        self.provider = provider


class BuildError(OpmuxError, RuntimeError):
    """Compiling a native extension failed; the message carries the compiler's output."""


class PlatformError(OpmuxError, RuntimeError):
    """Platform resolution failed (unknown forced platform, several claim the machine)."""


class PluginLoadError(OpmuxError, RuntimeError):
    """A plugin failed to load and strict mode (``OPMUX_STRICT_PLUGINS=1``) is on.

    :ivar plugin: the entry-point name of the plugin.
    """

    def __init__(self, message: str, *, plugin: str):
        super().__init__(message)
        self.plugin = plugin


class UnknownRunnerError(OpmuxError, KeyError):
    """A runner ID is unknown or was released."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


for _cls in (
    OpmuxError,
    RegistrationError,
    SignatureMismatchError,
    UnknownOpError,
    ConfigError,
    OpInputError,
    ProviderUnavailableError,
    ProviderOutputError,
    BuildError,
    PlatformError,
    PluginLoadError,
    UnknownRunnerError,
):
    _cls.__module__ = "opmux"
del _cls
