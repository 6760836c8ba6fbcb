"""The one table printer of the ``opmux`` command (``info``, ``check`` and ``bench`` use it)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """Left-aligned columns two spaces apart, a dashed rule under the header, no trailing blanks.

    :param rows: the cells, one sequence per row (any value; shown with ``str``).
    :param header: the column titles; every row has as many cells.

    >>> print(format_table([("rms_norm", "cpp", 1), ("silu_and_mul", "native", 12)],
    ...                    ("op", "provider", "rank")))
    op            provider  rank
    ------------  --------  ----
    rms_norm      cpp       1
    silu_and_mul  native    12
    """
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
