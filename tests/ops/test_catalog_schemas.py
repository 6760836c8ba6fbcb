"""docs/ops.md lists every catalog op's exact schema, as the registry has it."""

from __future__ import annotations

import re
from pathlib import Path

import opmux

DOC = Path(__file__).resolve().parents[2] / "docs" / "ops.md"


def test_ops_md_lists_every_catalog_schema_exactly() -> None:
    want = "".join(f"| `{op.name}` | `{op.schema}` |\n" for op in opmux.list_ops()
                   if op.native.__module__.startswith("opmux.ops."))
    found = re.search(r"<!-- schemas:begin -->\n\| op \| schema \|\n\| --- \| --- \|\n(.*?)"
                      r"<!-- schemas:end -->", DOC.read_text(), re.S)
    assert found is not None, "docs/ops.md has no schemas table"
    assert found.group(1) == want, f"replace the table rows of docs/ops.md with:\n{want}"
