"""The name-table rule of opmux's process-wide state."""

from __future__ import annotations

from opmux.core.state import claim


def test_claim_keeps_a_name_with_its_first_object() -> None:
    first, second = object(), object()
    table: dict[str, object] = {}
    assert claim(table, "a", first) is None and table == {"a": first}
    assert claim(table, "a", first) is None  # the same object again: still its own
    assert claim(table, "a", second) is first and table == {"a": first}
    assert claim(table, "b", second) is None and table["b"] is second
