"""Argument checks shared by the ``triton`` and ``cuda_c`` providers (no Triton import).

The catalog's own checks (``opmux.ops.checks.check_<op>``, run with the provider's name)
validate every argument before anything is launched, so a bad call writes nothing;
:func:`check` covers what only a provider needs. Errors are
:class:`~opmux.core.errors.OpInputError` naming op, provider, argument, expected and got.
"""

from __future__ import annotations

from opmux.ops.checks import input_error

__all__ = ["check"]


def check(ok: bool, op: str, argument: str, expected: str, got: object, *,
          provider: str = "triton") -> None:
    """Raise :class:`~opmux.core.errors.OpInputError` unless ``ok`` (built by
    :func:`opmux.ops.checks.input_error`: one message format, ``op``/``provider``/``argument``
    set).

    :param ok: the condition that must hold.
    :param op: op name, e.g. ``"rms_norm"``.
    :param argument: the argument at fault.
    :param expected: what the provider needs.
    :param got: what it received.
    :param provider: the provider raising.
    """
    if not ok:
        raise input_error(op, provider, argument, expected, got)
