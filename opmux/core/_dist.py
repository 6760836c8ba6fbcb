"""Name and version of an installed distribution without parsing all of its metadata.

``Distribution.name`` / ``.version`` parse the whole METADATA file with the email parser on
every access (opmux's own holds the README: milliseconds each); start-up and the tuned
fingerprint only need two header lines.
"""

from __future__ import annotations

from typing import Any

__all__ = ["dist_headers", "dist_label"]


def dist_headers(dist: Any) -> dict[str, str]:
    """The ``Name`` and ``Version`` headers of ``dist`` (an ``importlib.metadata``
    distribution); empty strings where the metadata lacks them."""
    found = {"Name": "", "Version": ""}
    try:
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    except OSError:
        text = ""
    for line in text.splitlines():
        if not line.strip():
            break  # the headers end at the first blank line
        name, sep, value = line.partition(":")
        if sep and name in found and not found[name]:
            found[name] = value.strip()
    return found


def dist_label(dist: Any) -> str:
    """``"name version"`` of ``dist``, as :attr:`opmux.PluginRecord.dist` shows it."""
    headers = dist_headers(dist)
    return f"{headers['Name']} {headers['Version']}".strip()
