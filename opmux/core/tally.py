"""Which provider served each op call, counted over a block of code (beside
:mod:`opmux.core.trace`, which counts a whole process's calls for ``OPMUX_TRACE``).

:class:`ProviderTally` swaps :class:`opmux.Op`'s call for one that, for the ops it
watches, asks :meth:`opmux.Op.dispatch` which implementation the arguments select, counts
it, and calls on; on exit the call it replaced is back (tallies nest). Nothing is
installed outside the ``with`` block, so the tally costs nothing when unused; inside, it
costs one selection per call (the provider is recorded exactly, predicates included).

>>> import torch, opmux
>>> with ProviderTally(["silu_and_mul"]) as tally:
...     _ = opmux.ops.silu_and_mul(torch.ones(2, 8))
>>> sum(tally.counts["silu_and_mul"].values())
1
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from opmux.core.op import Op
from opmux.core.registry import get_op

__all__ = ["ProviderTally", "counting"]

_PLAIN_CALL = Op.__dict__["__call__"]


def counting() -> bool:
    """Whether a :class:`ProviderTally` is counting (its call stands in for
    ``Op.__call__``): a caller that would run a provider's kernels without an op call makes
    the op calls instead."""
    return Op.__dict__["__call__"] is not _PLAIN_CALL


class ProviderTally:
    """Count calls per ``(op, provider)`` for the named catalog ops (a context manager).

    :param names: op names (``"paged_attention"``) or qualified names.
    :ivar counts: op name → Counter of provider → calls.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names = list(names)
        self.counts: dict[str, Counter[str]] = {}
        self._saved: list[Any] = []

    def __enter__(self) -> ProviderTally:
        watched: dict[int, Counter[str]] = {}
        for name in self.names:
            watched[id(get_op(name))] = self.counts.setdefault(name, Counter())
        original = Op.__dict__["__call__"]

        def counted(op: Op, *args: Any, **kwargs: Any) -> Any:
            counter = watched.get(id(op))
            if counter is not None:
                counter[op.dispatch(*args, **kwargs).provider] += 1
            return original(op, *args, **kwargs)

        self._saved.append(original)
        setattr(Op, "__call__", counted)  # noqa: B010
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        while self._saved:
            setattr(Op, "__call__", self._saved.pop())  # noqa: B010

    def providers(self) -> dict[str, str]:
        """op → the provider that served most of its calls (ops never called left out)."""
        return {name: c.most_common(1)[0][0] for name, c in self.counts.items() if c}

    def calls(self) -> dict[str, dict[str, int]]:
        """op → provider → calls (ops never called left out)."""
        return {name: dict(c) for name, c in self.counts.items() if c}
