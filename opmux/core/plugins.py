"""Plugin discovery and loading with pluggy.

Plugins are modules named by entry points in group :data:`PLUGIN_GROUP`. An entry module
is small: it defines hook implementations (marked with :data:`hookimpl`) and imports its
heavy backends inside ``opmux_register``. Loading happens once per process, lazily on
the first op call (or explicitly with :func:`load_plugins`), in spawned workers too.

Every hook is isolated the same way: a plugin that fails to import, raises in (or returns
garbage from) ``opmux_plugin_info``, ``opmux_platforms``, ``opmux_register`` or
``opmux_default_priority``, or registers something invalid, is recorded as ``failed`` with
its traceback, everything it registered is rolled back (its providers leave their ops; an
op it defined leaves the registry but stays defined in torch with its native kernel,
since torch cannot undefine one op of a shared library), and the others load. With
``OPMUX_STRICT_PLUGINS=1`` the failure is still recorded and rolled back, and start-up
raises :class:`~opmux.PluginLoadError`, on every call, until the plugin or the setting is
fixed.

**Priority merge rule** (independent of plugin names and install order): each loaded
plugin's ``opmux_default_priority`` answer for an op is first reduced to the providers
the op has (``native`` dropped). A plugin whose ``opmux_plugin_info()["platforms"]``
names the current platform is *specific*; one that serves it only through ``"*"`` is
*generic*. Specific answers come first, then generic ones add the providers not yet
listed. Within one tier, answers must agree exactly; if they differ, the tier gives no
opinion for that op (the next tier, the platform default and ``OPMUX_PRIORITY`` decide)
and the conflict is recorded on each plugin's :attr:`PluginRecord.conflicts`. Set the
winner explicitly with ``OPMUX_PRIORITY`` or :meth:`~opmux.Op.set_default_priority`.
"""

from __future__ import annotations

import importlib.metadata
import sys
import threading
import traceback
import types
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

import pluggy

from opmux.core import config, tuned
from opmux.core._dist import dist_label
from opmux.core.config import ENV_PLUGINS, ENV_STRICT_PLUGINS
from opmux.core.errors import PluginLoadError, UnknownOpError
from opmux.core.plugin_journal import PluginJournal
from opmux.core.priority import NATIVE
from opmux.core.state import runtime

if TYPE_CHECKING:
    from opmux.core.op import Op
    from opmux.core.registry import OpRegistry
    from opmux.platforms.base import Platform

__all__ = ["PLUGIN_GROUP", "PluginRecord", "PluginState", "activate", "apply_priorities",
           "check_strict", "discover", "discovered_platforms", "hookimpl", "hookspec",
           "plugin_report"]

PROJECT: Final = "opmux"
PLUGIN_GROUP: Final = "opmux.plugins"
"""Entry-point group of opmux plugins, built-in and third-party alike; read on the first
op call of a process (or by :func:`load_plugins`)."""

hookspec = pluggy.HookspecMarker(PROJECT)
#: Marker for plugin hook implementations: ``@opmux.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT)


class _HookSpecs:
    """The hooks a plugin may implement."""

    @hookspec
    def opmux_plugin_info(self) -> dict[str, Any]:  # type: ignore[empty-body]
        """``{"name": str, "platforms": ["cuda", ...]}`` (``"*"`` = any platform).

        Called before the plugin's other hooks; must not import heavy code.
        """

    @hookspec
    def opmux_platforms(self) -> list[type[Platform]]:  # type: ignore[empty-body]
        """Extra (out-of-tree) :class:`~opmux.Platform` classes this plugin contributes."""

    @hookspec
    def opmux_register(self, registry: OpRegistry, platform: Platform) -> None:
        """Register providers (``registry.get_op(name).register_impl(...)``) or new ops."""

    @hookspec
    def opmux_default_priority(self, op_name: str,  # type: ignore[empty-body]
                               platform: Platform) -> list[str] | None:
        """Preferred provider order for ``op_name`` on ``platform``, or ``None``."""


@dataclass
class PluginRecord:
    """What happened to one plugin."""

    #: entry-point name.
    name: str
    #: ``"loaded"``, ``"skipped"``, ``"failed"``, ``"discovered"`` (not yet activated) or
    #: ``"missing"`` (named in ``OPMUX_PLUGINS`` but not installed).
    status: str
    #: why it was skipped or failed (empty when loaded).
    reason: str = ""
    #: the entry point's value, ``module`` or ``module:attr``.
    value: str = ""
    #: distribution providing it, ``name version``.
    dist: str = ""
    #: platforms it serves, from ``opmux_plugin_info``.
    platforms: list[str] = field(default_factory=list)
    #: ``op:provider`` pairs it registered.
    providers: list[str] = field(default_factory=list)
    #: the traceback of a failure.
    traceback: str = ""
    #: ops whose default priority this plugin's answer could not set, and why (see the
    #: merge rule in :mod:`opmux.core.plugins`).
    conflicts: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_HOOKABLE: Final = (types.FunctionType, types.MethodType, staticmethod, classmethod)
"""What pluggy can take as a hook implementation."""
_MISSING: Final = object()
_ABSENT: Final = object()
"""What :func:`_call_one` returns for a plugin without the hook."""


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager, with a quicker look at a module's attributes when it registers one.

    pluggy looks every attribute of a plugin up with :func:`inspect.getattr_static` to find
    its hook implementations (a few hundred microseconds per entry module). An attribute of
    a plain module that cannot be one (not a function or method, or a function without the
    ``opmux_impl`` marker) is skipped here without that lookup; every other attribute, and
    every plugin that is not a plain module, goes through pluggy's own parsing.
    """

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        if type(plugin) is ModuleType and _not_a_hookimpl(plugin.__dict__.get(name, _MISSING)):
            return None
        return super().parse_hookimpl_opts(plugin, name)


def _not_a_hookimpl(value: object) -> bool:
    if value is _MISSING:
        return False  # not in the module's own dict: pluggy decides
    if type(value) is types.FunctionType:
        return f"{PROJECT}_impl" not in value.__dict__
    return not isinstance(value, _HOOKABLE)


class PluginState:
    """The plugin manager, what happened to each plugin and what each registered (a field
    of the runtime object)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        #: pluggy's manager; ``pm.trace``, ``add_hookcall_monitoring`` and hook wrappers
        #: apply to every hook call start-up makes
        self.pm = _PluginManager(PROJECT)
        self.pm.add_hookspecs(_HookSpecs)
        self.records: dict[str, PluginRecord] = {}
        self.modules: dict[str, ModuleType] = {}
        self.platforms: dict[str, list[type[Platform]]] = {}
        #: each loaded plugin's default-priority answers: ``{plugin: {qualname: [...]}}``
        self.answers: dict[str, dict[str, list[str]]] = {}
        #: each record's distribution, read into ``PluginRecord.dist`` when first reported
        self.dists: dict[str, Any] = {}
        self.discovered = False
        self.activated = False
        #: what each plugin registered (rolled back when it fails, or by the reset)
        self.journal = PluginJournal()


def plugin_state() -> PluginState:
    """This process's plugin state (a field of the runtime object)."""
    return runtime().plugins


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    """The installed entry points of :data:`PLUGIN_GROUP`, sorted by name."""
    return sorted(importlib.metadata.entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name)


def _each(state: PluginState, hook: str, names: list[str] | None = None
          ) -> list[tuple[str, Callable[..., list[Any]]]]:
    """One caller per plugin implementing ``hook`` (wrappers excepted): ``(plugin name,
    caller)``, ``tryfirst`` implementations first and ``trylast`` ones last, as pluggy
    orders them, and by plugin name within each group (so the order never depends on
    install order).

    Each caller is pluggy's own hook caller restricted to that plugin and every plugin that
    wraps the hook, so wrappers, ``pm.trace`` and hook-call monitoring apply, while each
    plugin's call can fail (and be rolled back) on its own.
    """
    pm = state.pm
    wrappers = {id(i.plugin) for i in getattr(pm.hook, hook).get_hookimpls()
                if i.wrapper or i.hookwrapper}
    callers: list[tuple[str, Callable[..., list[Any]]]] = []
    for impl in _implementers(state, hook, names):
        others = [p for p in pm.get_plugins()
                  if p is not impl.plugin and id(p) not in wrappers]
        callers.append((impl.plugin_name, pm.subset_hook_caller(hook, others)))
    return callers


def _implementers(state: PluginState, hook: str, names: list[str] | None = None
                  ) -> list[Any]:
    """The hook implementations of ``hook`` (wrappers excepted), in :func:`_each`'s order."""
    impls = getattr(state.pm.hook, hook).get_hookimpls()
    return sorted((i for i in impls if not (i.wrapper or i.hookwrapper)
                   and (names is None or i.plugin_name in names)),
                  key=lambda i: (not i.tryfirst, i.trylast, i.plugin_name))


def _fail(state: PluginState, rec: PluginRecord, reason: str, exc: BaseException,
          registry: OpRegistry | None = None) -> None:
    """Record a failure and undo the plugin: hooks unregistered, registrations rolled back.

    Says so in one line on stderr (name, stage, error), once: a plugin fails at most once
    per start-up.
    """
    rec.status, rec.reason = "failed", reason
    _say(f"plugin {rec.name!r} failed and was skipped: {reason.splitlines()[0]} (`opmux "
         f"info` shows the traceback; {ENV_STRICT_PLUGINS}=1 makes this fatal)")
    rec.providers = []
    rec.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    module = state.modules.pop(rec.name, None)
    state.platforms.pop(rec.name, None)
    state.answers.pop(rec.name, None)
    journal = state.journal.kept.pop(rec.name, None)
    if journal is not None and registry is not None:
        state.journal.rollback(*journal)
    if module is not None and state.pm.is_registered(module):
        state.pm.unregister(module)


def check_strict(state: PluginState) -> None:
    """Raise :class:`PluginLoadError` if strict mode is on and a plugin failed."""
    failed = sorted((r for r in state.records.values() if r.status == "failed"),
                    key=lambda r: r.name)
    if failed and config.strict_plugins():
        first = failed[0]
        others = f" (also failed: {', '.join(r.name for r in failed[1:])})" if failed[1:] else ""
        raise PluginLoadError(
            f"plugin {first.name!r} failed: {first.reason}{others} (strict mode: fix the "
            f"plugin, or unset {ENV_STRICT_PLUGINS} to skip failing plugins)",
            plugin=first.name)


def discover(state: PluginState) -> None:
    """Import each allowed entry module, validate its hooks, read its info and platforms.

    :raises ConfigError: ``OPMUX_PLUGINS`` is malformed (nothing is marked discovered,
        so the next attempt reads it again).
    """
    if state.discovered:
        return
    allow = config.plugin_allow_list()
    config.strict_plugins()  # a malformed value is fatal before anything loads
    entry_points = _entry_points()
    state.discovered = True
    if allow is not None:
        missing = sorted(allow - {ep.name for ep in entry_points})
        for name in missing:
            state.records[name] = PluginRecord(
                name, "missing", reason=f"named in {ENV_PLUGINS} but no installed plugin has "
                                        f"this name")
        if missing:
            warnings.warn(f"{ENV_PLUGINS} names plugin(s) {missing} that are not installed; "
                          f"installed: {sorted(ep.name for ep in entry_points)}",
                          RuntimeWarning, stacklevel=2)
    for ep in entry_points:
        rec = PluginRecord(ep.name, "discovered", value=ep.value)
        if ep.name in state.records:
            state.records[f"{ep.name} ({ep.value})"] = rec
            state.dists[f"{ep.name} ({ep.value})"] = getattr(ep, "dist", None)
            rec.status, rec.reason = "skipped", "another entry point has the same name"
            continue
        state.records[ep.name] = rec
        state.dists[ep.name] = getattr(ep, "dist", None)
        if allow is not None and ep.name not in allow:
            rec.status, rec.reason = "skipped", f"not in {ENV_PLUGINS}={','.join(sorted(allow))}"
            continue
        try:
            module = ep.load()
        except Exception as exc:
            _fail(state, rec, f"import of {ep.value!r} raised {type(exc).__name__}: {exc}", exc)
            continue
        try:
            state.pm.register(module, name=ep.name)
            state.modules[ep.name] = module
            info = _call_one(state, "opmux_plugin_info", ep.name)
            if info is _ABSENT:
                raise TypeError(f"plugin module {module.__name__!r} does not define "
                                f"opmux_plugin_info(); every plugin must")
            if (not isinstance(info, dict) or not isinstance(info.get("platforms"), list)
                    or not all(isinstance(p, str) for p in info["platforms"])):
                raise TypeError(
                    f"opmux_plugin_info() must return {{'name': str, 'platforms': [str, ...]}}, "
                    f"got {info!r}")
            rec.platforms = list(info["platforms"])
        except Exception as exc:
            _fail(state, rec, f"opmux_plugin_info: {type(exc).__name__}: {exc}", exc)
            continue
        try:
            extra = _call_one(state, "opmux_platforms", ep.name)
            if extra is _ABSENT:
                extra = None
            if extra is not None and (not isinstance(extra, (list, tuple)) or not all(
                    isinstance(c, type) and isinstance(getattr(c, "name", None), str)
                    for c in extra)):
                raise TypeError(f"opmux_platforms() must return a list of Platform classes, "
                                f"got {extra!r}")
            if extra:
                state.platforms[ep.name] = list(extra)
        except Exception as exc:
            _fail(state, rec, f"opmux_platforms: {type(exc).__name__}: {exc}", exc)


def _call_one(state: PluginState, hook: str, name: str, journal: OpRegistry | None = None,
              **kwargs: Any) -> Any:
    """Plugin ``name``'s ``hook`` through pluggy (wrappers apply), or :data:`_ABSENT` when
    the plugin does not implement it.

    An exception raised by another plugin's hook wrapper is that plugin's failure, not
    this one's: the wrapper's plugin fails (and is rolled back from ``registry``) and the
    call is made again without it. ``journal``: the registry whose open journal holds what
    ``name``'s attempt registered, undone before the retry.
    """
    while True:
        callers = _each(state, hook, [name])
        if not callers:
            return _ABSENT
        try:
            results = callers[0][1](**kwargs)  # pluggy leaves a None result out of the list
        except Exception as exc:
            if not _blame_wrapper(state, hook, name, exc, journal):
                raise
            if journal is not None:  # the retry starts from nothing registered
                state.journal.end(rollback=True)
                state.journal.begin(journal, name)
            continue
        return results[0] if results else None


def _blame_wrapper(state: PluginState, hook: str, name: str, exc: Exception,
                   registry: OpRegistry | None) -> bool:
    """If another plugin's implementation of ``hook`` (a wrapper) raised ``exc`` during
    ``name``'s call, fail that plugin (rolled back from ``registry``) and return True, so
    that the caller retries; else False."""
    culprit = _culprit(state, hook, name, exc)
    if culprit is None or culprit == name:
        return False
    _fail(state, state.records[culprit],
          f"{hook} hook wrapper raised {type(exc).__name__}: {exc}", exc, registry)
    return True


def _culprit(state: PluginState, hook: str, name: str, exc: BaseException) -> str | None:
    """Who raised ``exc`` in plugin ``name``'s call of ``hook``: ``name`` or the plugin of a
    hook wrapper, whichever has the innermost frame in its traceback (an exception passing
    through a wrapper's ``yield`` has the raising plugin's frame deeper than the wrapper's)."""
    owners: dict[Any, str] = {}
    impls = getattr(state.pm.hook, hook).get_hookimpls()
    for impl in sorted(impls, key=lambda i: i.plugin_name == name):  # ``name``'s own last
        code = getattr(impl.function, "__code__", None)
        if code is not None and (impl.wrapper or impl.hookwrapper or impl.plugin_name == name):
            owners[code] = impl.plugin_name
    found = None
    tb = exc.__traceback__
    while tb is not None:
        found = owners.get(tb.tb_frame.f_code, found)
        tb = tb.tb_next
    return found


def discovered_platforms() -> list[type[Platform]]:
    """The out-of-tree platform classes of the installed plugins (discovering them)."""
    state = plugin_state()
    with state.lock:
        discover(state)
        return [cls for classes in state.platforms.values() for cls in classes]


def activate(state: PluginState, registry: OpRegistry, platform: Platform) -> None:
    """Run ``opmux_register``, then ``opmux_default_priority``, of every plugin (once).

    Each plugin's registrations are journaled; a failure in either hook rolls that
    plugin back and records it, and the others are unaffected.
    """
    if state.activated:
        return
    state.activated = True
    for name, module in list(state.modules.items()):
        rec = state.records[name]
        if "*" not in rec.platforms and platform.name not in rec.platforms:
            rec.status = "skipped"
            rec.reason = (f"platform mismatch: serves {rec.platforms}, current platform is "
                          f"{platform.name!r}")
            state.pm.unregister(module)
            del state.modules[name]
    # a platform's own plugins first, then the built-in generic ones, then the others; within
    # a rank pluggy's tryfirst/trylast, then names: the first to register a provider name
    # keeps it, so a generic plugin can never take a name from the platform's own plugin
    called = [i.plugin_name for i in _implementers(state, "opmux_register")]
    order = sorted(state.modules, key=lambda n: (
        _rank(state.records[n], platform), n not in called,
        called.index(n) if n in called else 0))
    for name in order:
        rec = state.records[name]
        if rec.status == "failed":
            continue  # blamed for another plugin's failure as a hook wrapper
        state.journal.begin(registry, name)
        try:
            _call_one(state, "opmux_register", name, registry, registry=registry,
                      platform=platform)
        except Exception as exc:
            state.journal.end(rollback=True)
            _fail(state, rec, f"opmux_register raised {type(exc).__name__}: {exc}", exc)
            continue
        journal = state.journal.end(rollback=False)
        state.journal.kept[name] = journal
        rec.providers = [f"{op.qualname}:{provider}" for op, provider in journal[0]]
        rec.status = "loaded"
    ops = registry.list_ops()
    callers: dict[str, Callable[..., list[Any]]] = {}
    for name in [i.plugin_name for i in _implementers(state, "opmux_default_priority",
                                                       list(state.modules))]:
        rec = state.records[name]
        if rec.status == "failed":
            continue  # a hook wrapper blamed while another plugin was asked
        answers: dict[str, list[str]] = {}
        try:
            for op in ops:
                result = _ask_priority(state, name, registry, op, platform, callers)
                if result is None:
                    continue
                if isinstance(result, (str, bytes)) or not isinstance(result, (list, tuple)) \
                        or not all(isinstance(p, str) for p in result):
                    raise TypeError(f"opmux_default_priority({_asked_name(op)!r}) must return "
                                    f"a list of provider names or None, got {result!r}")
                answers[op.qualname] = list(result)
        except Exception as exc:
            _fail(state, rec, f"opmux_default_priority raised {type(exc).__name__}: {exc}",
                  exc, registry)
            continue
        state.answers[name] = answers


def _ask_priority(state: PluginState, name: str, registry: OpRegistry, op: Op,
                  platform: Platform, callers: dict[str, Callable[..., list[Any]]]) -> Any:
    """Plugin ``name``'s ``opmux_default_priority`` answer for ``op`` (``None``: none);
    ``callers`` keeps each plugin's hook caller between ops."""
    hook = "opmux_default_priority"
    while True:
        caller = callers.get(name)
        if caller is None:
            caller = callers[name] = _each(state, hook, [name])[0][1]
        try:
            results = caller(op_name=_asked_name(op), platform=platform)
        except Exception as exc:
            if not _blame_wrapper(state, hook, name, exc, registry):
                raise
            callers.clear()  # built with the failed plugin's wrapper
            continue
        return results[0] if results else None


def _asked_name(op: Op) -> str:
    """The name hooks and platforms are asked about: the one :func:`opmux.get_op` takes in
    its shortest form (``"rms_norm"`` for a catalog op, ``"acme::softcap"`` otherwise)."""
    return op.name if op.namespace == "opmux" else op.qualname


def _rank(rec: PluginRecord, platform: Platform) -> int:
    """0: the plugin names the current platform; 1: a built-in plugin serving it through
    ``"*"``; 2: any other generic plugin."""
    if platform.name in rec.platforms:
        return 0
    return 1 if rec.value.split(":")[0].startswith("opmux.plugins.") else 2


def _merged_priority(state: PluginState, op: Op, platform: Platform) -> list[str] | None:
    """The plugins' default priority for ``op`` under the merge rule (module docstring)."""
    tiers: tuple[dict[str, tuple[str, ...]], ...] = ({}, {}, {})
    for name, answers in state.answers.items():
        answer = answers.get(op.qualname)
        if not answer:
            continue
        known = tuple(p for p in dict.fromkeys(answer) if p != NATIVE and op.has_provider(p))
        if known:
            tiers[_rank(state.records[name], platform)][name] = known
    merged: list[str] = []
    conflicted = False
    for tier, label in zip(tiers, ("platform-specific", "built-in generic", "generic"),
                           strict=True):
        distinct = set(tier.values())
        if len(distinct) > 1:
            conflicted = True
            detail = "; ".join(f"{n}: {list(tier[n])}" for n in sorted(tier))
            for n in tier:
                state.records[n].conflicts.append(
                    f"{op.qualname}: {label} plugins disagree ({detail}); none of them sets "
                    f"this op's default (use OPMUX_PRIORITY or set_default_priority)")
            continue
        for agreed in distinct:
            merged.extend(p for p in agreed if p not in merged)
    if not merged and conflicted:
        # every opinion was a conflict: with no layer here the registration order would
        # pick, i.e. the plugins' load order, i.e. their names. The platform's
        # default decides, else native (the disputed providers listed after it never run)
        # until OPMUX_PRIORITY or code chooses
        disputed = sorted({p for tier in tiers for answer in tier.values() for p in answer})
        return list(platform.default_priority(_asked_name(op)) or [NATIVE, *disputed])
    return merged or None


def apply_priorities(state: PluginState, registry: OpRegistry, platform: Platform) -> None:
    """Compose priority defaults: platform → plugins (merge rule) → tuned table (see
    :mod:`opmux.core.tuned`; never fatal) → ``OPMUX_PRIORITY``.

    An ``OPMUX_PRIORITY`` entry naming an op or provider that is not registered (a plugin
    failed or was uninstalled) is one line on stderr, naming any failed plugin; the op runs
    the rest of its list.

    :raises ConfigError: ``OPMUX_PRIORITY`` is malformed.
    """
    env = config.priority_overrides()  # parsed first: a malformed value changes nothing
    for rec in state.records.values():
        rec.conflicts.clear()
    ops = registry.list_ops()
    for op in ops:
        op.priorities.set_layer("platform", platform.default_priority(_asked_name(op)) or None,
                      strict=False)
        op.priorities.set_layer("plugins", _merged_priority(state, op, platform), strict=False)
    tuned.apply_tuned(registry, platform, ops)
    resolved: list[tuple[Op, list[str] | None]] = []
    for op_name, providers in env.items():
        try:
            op = registry.get_op(op_name)
        except UnknownOpError:
            _say(f"{config.ENV_PRIORITY} names op {op_name!r}, which is not registered; its "
                 f"entry is ignored (ops: `opmux info`){_failed_plugins(state)}")
            continue
        unknown = [p for p in providers if not op.has_provider(p)]
        if unknown:
            providers = [p for p in providers if op.has_provider(p)]
            _say(f"{config.ENV_PRIORITY}: op {op_name!r} has no provider(s) {unknown} "
                 f"(registered: {sorted(op.impls)}); it runs the rest of the list, "
                 f"{[*providers, NATIVE] if NATIVE not in providers else providers}"
                 f"{_failed_plugins(state)}")
        resolved.append((op, providers or None))
    for op in ops:
        op.priorities.set_layer("env", None)
    for op, kept in resolved:
        op.priorities.set_layer("env", kept)


def _say(line: str) -> None:
    """One line on stderr: what start-up could not do as asked and what it does instead."""
    print(f"opmux: {line}", file=sys.stderr)


def _failed_plugins(state: PluginState) -> str:
    """``"; plugin 'x' failed: why"`` for each failed plugin (empty when none failed)."""
    return "".join(f"; plugin {r.name!r} failed: {r.reason.splitlines()[0]}"
                   for r in sorted(state.records.values(), key=lambda r: r.name)
                   if r.status == "failed")


def plugin_report() -> list[PluginRecord]:
    """Every plugin seen, with its status and why (a snapshot)."""
    state = plugin_state()
    with state.lock:
        labels: dict[int, str] = {}  # built-in plugins share one distribution
        for key, rec in state.records.items():
            dist = state.dists.pop(key, None)
            if dist is not None:
                rec.dist = labels.get(id(dist)) or labels.setdefault(id(dist), dist_label(dist))
        return [PluginRecord(**r.as_dict()) for r in state.records.values()]
