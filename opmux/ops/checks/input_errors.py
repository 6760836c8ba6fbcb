"""The one error every input check raises, and how its message shows a value.

Every error is an :class:`opmux.OpInputError` built by :func:`input_error`, with ``.op``
(``"opmux::name"``), ``.provider`` and ``.argument`` set and one message format::

    opmux::rms_norm (provider 'cpp'): argument 'eps' expected a non-negative float, got -1.0

It is raised before the op writes anything; :func:`kernel_error` puts a compiled kernel's
refusal in the same format.
"""

from __future__ import annotations

import re
from typing import Final

from torch import Tensor

from opmux.core.errors import OpInputError

__all__ = ["input_error", "kernel_error", "shape_text", "value_text"]

_ARGUMENT_RE: Final = re.compile(r"argument '([A-Za-z_][A-Za-z0-9_]*)'")
_PREFIX_RE: Final = re.compile(r"^[\w:]+ \(provider '\w+'\): ")


def _qualname(op: str) -> str:
    return op if "::" in op else f"opmux::{op}"


def input_error(op: str, provider: str, argument: str, expected: str,
                got: object) -> OpInputError:
    """Build the one error every check raises.

    Message: ``opmux::op (provider 'p'): argument 'a' expected E, got G``; the error
    carries ``op`` (qualified), ``provider`` and ``argument``.

    :param op: op name, bare (``"rms_norm"``, namespace ``opmux``) or qualified.
    :param provider: the provider that refused the call (``"native"``, ``"cpp"``, ...).
    :param argument: the offending argument's name.
    :param expected: what the op needs, as a phrase (``"a 2-d tensor [T, H*D]"``).
    :param got: what it received (formatted with ``str``).
    """
    qualname = _qualname(op)
    return OpInputError(
        f"{qualname} (provider {provider!r}): argument {argument!r} expected {expected}, "
        f"got {got}", op=qualname, provider=provider, argument=argument,
    )


def kernel_error(op: str, provider: str, exc: BaseException,
                 argument: str | None = None) -> OpInputError:
    """Wrap an error a compiled kernel raised for bad input into the standard error.

    The shared checks run before any kernel, so this is the backstop for a condition only
    the kernel can see. The argument is taken from ``argument``, else from the kernel's
    message (``argument 'x'``), else ``"<kernel>"``.
    """
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = _PREFIX_RE.sub("", text)
    if argument is None:
        found = _ARGUMENT_RE.search(text)
        argument = found.group(1) if found else "<kernel>"
    qualname = _qualname(op)
    return OpInputError(f"{qualname} (provider {provider!r}): argument {argument!r} rejected "
                        f"by the kernel: {text}", op=qualname, provider=provider,
                        argument=argument)


def shape_text(t: Tensor) -> str:
    """``t``'s shape as an error message shows it: ``shape [2, 8]``."""
    return f"shape {list(t.shape)}"


def value_text(value: object) -> str:
    """A non-tensor argument as an error message shows it: its type, and its value when
    that is a number or a string (``int 3``, ``list``)."""
    return f"{type(value).__name__} {value!r}" if isinstance(value, (int, float, str)) \
        else type(value).__name__
