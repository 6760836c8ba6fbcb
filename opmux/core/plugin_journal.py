"""What each plugin registered, so that a failing plugin (or a reset) takes back its own.

:class:`PluginJournal` is the plugin loader's record (a field of
:class:`opmux.core.plugins.PluginState`): while one plugin's ``opmux_register`` runs, the
open journal notes each provider and op it registers in the registry start-up loads; a
finished plugin's journal is kept under its name. The op and the registry report each
registration here, and the duplicate-provider error reads :meth:`PluginJournal.clash` to say
which plugins collide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opmux.core.op import Op
    from opmux.core.registry import OpRegistry

__all__ = ["PluginJournal"]

Entries = tuple[list[tuple["Op", str]], list["Op"]]


class PluginJournal:
    """The open journal, the kept ones and the owner of each ``(op, provider)`` pair."""

    def __init__(self) -> None:
        #: the journal of the plugin whose ``opmux_register`` runs now: its registry, its
        #: name, the ``(op, provider)`` pairs and the ops it registered there
        self.open: tuple[OpRegistry, str, list[tuple[Op, str]], list[Op]] | None = None
        #: what each activated plugin registered: ``(providers, ops)`` for rollback
        self.kept: dict[str, Entries] = {}
        #: the plugin that registered each ``(op qualname, provider)`` pair
        self.owners: dict[tuple[str, str], str] = {}

    def begin(self, registry: OpRegistry, name: str) -> None:
        """Start recording what plugin ``name`` registers in ``registry``."""
        self.open = (registry, name, [], [])

    def end(self, *, rollback: bool) -> Entries:
        """Stop recording; return (and with ``rollback``, undo) what was registered."""
        journal, self.open = self.open, None
        if journal is None:
            return [], []
        if rollback:
            self.rollback(journal[2], journal[3])
        return journal[2], journal[3]

    def rollback(self, providers: list[tuple[Op, str]], ops: list[Op], *,
                 forget_ops: bool = True) -> None:
        """Unregister journaled providers and (``forget_ops``) forget journaled ops.

        torch cannot undefine one op of a shared library: a forgotten op stays defined in
        torch with its native kernel only (calling it runs native), but it leaves the
        registry, so ``get_op`` no longer finds it.
        """
        for op, provider in reversed(providers):
            if op.has_provider(provider):
                op.unregister_impl(provider)
            self.owners.pop((op.qualname, provider), None)
        if forget_ops:
            for op in ops:
                op.registry.forget_op(op)

    def record_impl(self, op: Op, provider: str) -> None:
        """Note a provider registration in the open journal (if ``op`` is of its registry)."""
        journal = self.open
        if journal is not None and op.registry is journal[0]:
            journal[2].append((op, provider))
            self.owners[(op.qualname, provider)] = journal[1]

    def record_op(self, op: Op) -> None:
        """Note an op definition in the open journal (if ``op`` is of its registry)."""
        journal = self.open
        if journal is not None and op.registry is journal[0]:
            journal[3].append(op)

    def clash(self, op: Op, provider: str) -> str:
        """The words that say who holds ``provider`` of ``op`` and who asks for it again:
        ``" by plugin 'a'; plugin 'b' cannot register it too"`` (empty when unknown)."""
        holder = self.owners.get((op.qualname, provider))
        journal = self.open
        asking = journal[1] if journal is not None and op.registry is journal[0] else None
        if holder is None and asking is None:
            return ""
        held = f" by plugin {holder!r}" if holder is not None else " outside any plugin"
        asked = (f"; plugin {asking!r} cannot register it too (rename its provider, or "
                 f"uninstall one of the two)") if asking is not None else ""
        return held + asked
