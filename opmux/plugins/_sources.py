"""Where the native sources (``csrc``) of the built-in plugins are.

A wheel ships them as ``opmux/_csrc``; a source checkout (editable install) has them in
``csrc/`` at the top of the tree.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["csrc_root"]


def csrc_root() -> Path:
    """The folder holding ``cpu/``, ``cuda/`` and ``ascend/`` (``ascendc/``, ``ms_module/``)."""
    package = Path(__file__).resolve().parents[1]
    shipped = package / "_csrc"
    return shipped if shipped.is_dir() else package.parent / "csrc"
