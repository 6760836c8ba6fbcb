"""An example third-party opmux plugin (see ``plugin.py`` for the hooks)."""
