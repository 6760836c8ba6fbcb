"""The per-key chooser: what an op's kernel walks on every call (the dispatch hot path).

A :class:`_KeyChain` holds the providers of one dispatch key in priority order, in the form
the hot path reads: ``pairs`` (``(supports_args, fn)`` per provider), ``direct`` (the first
provider's function when it takes every call), ``guard`` (the first provider's predicate
picks it or the next function, when that one takes every call: the next provider or native)
and, when a tuned table gives the op a
different order per shape bucket, ``sized``: one selector per bit length of the first
argument's ``numel()`` (64 entries, so the bucket is one index, no search), with ``pairs``
set to ``None`` so that an op without buckets pays one ``is None`` test. A bucket's selector
has the same shortcuts as the key (``(pred, fn, other, None)``: ``fn`` alone when ``pred`` is
``None``, else one test between ``fn`` and ``other``) and ``(None, None, None, pairs)`` for
the walk, so picking a bucket adds only the size lookup to the call.

Both selection functions (the torch kernel of a key, and the eager path used with the
torch wrap off) are generated from one template, :data:`_SELECT`, when the op is built or
gets its first provider for a key: the walk is written once, and each function keeps the
calling convention it needs (positional only for the dispatcher; keywords and a device
lookup for the eager path) without an extra call per dispatch. The ``supports_args``
predicates the built-in plugins derive from their checks (:func:`make_predicate`) are compiled
the same way. The compiled variants are kept in ``$OPMUX_CACHE_DIR/chooser/`` (a damaged or
unwritable copy only costs the compile).

A torch kernel also has shorter bodies, :data:`_DIRECT`, :data:`_GUARD` and :data:`_SIZED`:
once its registry has finished start-up, :meth:`_KeyChain.specialize` gives the kernel the body
of its key's form (``kernel.__code__``), which skips the start-up test and the tests of the
other forms. Each checks its own shortcut first and otherwise calls the full walk (``walk``, the
same code as the general kernel, start-up test included), so a body that no longer matches the
selection (a reader racing a change of priorities) is slower for a call, never wrong. The
registry puts the general body back whenever it is no longer loaded (a reset for tests), so
that the first call runs start-up again.
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from types import CodeType
from typing import TYPE_CHECKING, Any, Final, final

from opmux.core import config
from opmux.core._files import write_quietly

if TYPE_CHECKING:
    from opmux.core.op import OpImpl

__all__ = ["SIZE_BUCKETS", "bucket_of", "make_eager", "make_kernel", "make_predicate"]

SIZE_BUCKETS: Final = 64
"""Size buckets: bucket ``b`` holds calls whose first argument has ``numel().bit_length() == b``
(``numel`` in ``[2**(b-1), 2**b)``; bucket 0 is an empty tensor)."""

Pairs = tuple[tuple[Callable[..., bool] | None, Callable[..., Any]], ...]
#: one size bucket's selection: ``(pred, fn, other, pairs)`` (see the module docstring)
Selector = tuple[Callable[..., bool] | None, Callable[..., Any] | None,
                 Callable[..., Any] | None, Pairs | None]


def bucket_of(numel: int) -> int:
    """The size bucket of a first argument with ``numel`` elements."""
    return int(numel).bit_length()


@final
class _KeyChain:
    """The providers of one dispatch key, in priority order (mutable holder)."""

    __slots__ = ("bodies", "chain", "direct", "guard", "kernel", "key", "loaded", "pairs",
                 "sized", "sized_chains", "unsized")

    def __init__(self, key: str) -> None:
        self.key = key
        self.chain: tuple[OpImpl, ...] = ()
        #: ``(supports_args, fn)`` of each chain entry: what the hot path reads; ``None``
        #: while size buckets are set (the walk then reads ``sized``)
        self.pairs: Pairs | None = ()
        #: the pairs of ``chain`` whether or not size buckets are set
        self.unsized: Pairs = ()
        #: the first provider's function when it takes every call (no ``supports_args``)
        self.direct: Callable[..., Any] | None = None
        #: ``(supports_args, fn, next_fn)`` when the first provider has a predicate and the
        #: next one (or native, when there is none) takes every call: one test, no walk
        self.guard: tuple[Callable[..., bool], Callable[..., Any], Callable[..., Any]] | None \
            = None
        #: per size bucket selector (a tuned table with different orders), else ``None``
        self.sized: tuple[Selector, ...] | None = None
        #: per size bucket chains (for ``dispatch`` / ``explain``), else ``None``
        self.sized_chains: tuple[tuple[OpImpl, ...], ...] | None = None
        #: the torch kernel walking this holder, its bodies (general, direct, guard, sized)
        #: and its registry's loaded flag; set by :func:`make_kernel`
        self.kernel: Callable[..., Any] | None = None
        self.bodies: tuple[CodeType, ...] | None = None
        self.loaded: list[bool] = [False]

    def set(self, chain: tuple[OpImpl, ...], fns: tuple[Callable[..., Any], ...],
            sized: list[tuple[tuple[OpImpl, ...], tuple[Callable[..., Any], ...]]] | None
            = None, native: Callable[..., Any] | None = None) -> None:
        """Publish a new selection; ``sized`` gives a chain per size bucket (64 entries)."""
        # readers see either the old or the new selection, never a mix: clear the shortcut,
        # publish the buckets and the pairs, then the new shortcut
        self.direct = self.guard = None
        self.unsized = _pairs(chain, fns)
        if sized is None:
            self.pairs = self.unsized
            self.sized = self.sized_chains = None
        else:
            self.sized_chains = tuple(c for c, _ in sized)
            self.sized = tuple(_selector(c, f, native) for c, f in sized)
            self.pairs = None
        self.chain = chain
        if sized is None:
            pred, fn, other, pairs = _selector(chain, fns, native)
            if pairs is None and pred is None:
                self.direct = fn
            elif pairs is None:
                assert pred is not None and fn is not None and other is not None
                self.guard = (pred, fn, other)
        self.specialize()

    def specialize(self) -> None:
        """Give the kernel the body of the current shortcut, or the general one while its
        registry is not loaded (each body is correct for any selection; see the module
        docstring)."""
        kernel, bodies = self.kernel, self.bodies
        if kernel is None or bodies is None:
            return
        body = bodies[0]
        if self.loaded[0]:
            if self.direct is not None:
                body = bodies[1]
            elif self.guard is not None:
                body = bodies[2]
            elif self.sized is not None:
                body = bodies[3]
        if kernel.__code__ is not body:
            kernel.__code__ = body

    def chain_for(self, first: Any, is_tensor: bool) -> tuple[OpImpl, ...]:
        """The chain a call whose first argument is ``first`` walks (not the hot path)."""
        if self.sized_chains is not None and is_tensor:
            return self.sized_chains[bucket_of(first.numel())]
        return self.chain


def _pairs(chain: tuple[OpImpl, ...], fns: tuple[Callable[..., Any], ...]) -> Pairs:
    return tuple((impl.supports_args, fn) for impl, fn in zip(chain, fns, strict=True))


def _selector(chain: tuple[OpImpl, ...], fns: tuple[Callable[..., Any], ...],
              native: Callable[..., Any] | None) -> Selector:
    """The shortest walk of ``chain``: its first function when that takes every call, one
    test when the next function (or native after a lone provider) takes every call, else
    the pairs."""
    if chain:
        pred = chain[0].supports_args
        if pred is None:
            return None, fns[0], None, None
        if len(chain) == 1 and native is not None:
            return pred, fns[0], native, None
        if len(chain) > 1 and chain[1].supports_args is None:
            return pred, fns[0], fns[1], None
    return None, None, None, _pairs(chain, fns)


def _block(text: str, spaces: int) -> str:
    return textwrap.indent(text, " " * spaces)


# Pieces of the selection functions below. ``{call}`` is how arguments are passed on.
# One test between ``chosen`` and ``other``:
_ONE_TEST: Final = """\
try:
    ok = pred({call})
except Exception:  # a predicate that raises declines (see opmux.core.op)
    ok = False
return chosen({call}) if ok else other({call})
"""

# A size bucket's selector (``{sized}``: the bucket of the first argument's size): its function
# alone or one test; else its ``pairs`` are left for the walk.
_BUCKET: Final = ("pred, chosen, other, pairs = {sized}\n"
                  "if pairs is None:\n"
                  "    if pred is None:\n"
                  "        return chosen({call})\n" + _block(_ONE_TEST, 4))

# The walk over ``pairs``, native last.
_WALK: Final = """\
for pred, fn in pairs:
    if pred is None:
        return fn({call})
    try:
        ok = pred({call})
    except Exception:  # a predicate that raises declines (see opmux.core.op)
        continue
    if ok:
        return fn({call})
return native({call})
"""

# The one walk over a chain (``pairs`` is None exactly when size buckets are set).
_SELECT: Final = ("def {name}({params}):\n"
                  "{prologue}\n"
                  "    direct = holder.direct\n"
                  "    if direct is not None:\n"
                  "        return direct({call})\n"
                  "    guard = holder.guard\n"
                  "    if guard is not None:\n"
                  "        pred, chosen, other = guard\n" + _block(_ONE_TEST, 8)
                  + "    pairs = holder.pairs\n"
                  "    if pairs is None:\n" + _block(_BUCKET, 8) + _block(_WALK, 4))

# The kernel bodies of a loaded registry (see the module docstring): one shortcut, else the walk.
_DIRECT: Final = """\
def {name}({params}):
    # HOT PATH (loaded, the key's first provider takes every call)
    direct = holder.direct
    if direct is not None:
        return direct({call})
    return walk({call})
"""

_GUARD: Final = ("def {name}({params}):\n"
                 "    # HOT PATH (loaded, one test between the first provider and the next one)\n"
                 "    guard = holder.guard\n"
                 "    if guard is not None:\n"
                 "        pred, chosen, other = guard\n" + _block(_ONE_TEST, 8)
                 + "    return walk({call})\n")

_SIZED: Final = ("def {name}({params}):\n"
                 "    # HOT PATH (loaded, a tuned table orders the providers per size bucket)\n"
                 "    sized = holder.sized\n"
                 "    if sized is not None:\n" + _block(_BUCKET, 8) + _block(_WALK, 8)
                 + "    return walk({call})\n")

_KERNEL_PROLOGUE: Final = """\
    # HOT PATH: the torch dispatcher calls this with every argument positional.
    if not loaded[0]:
        ensure_loaded()"""

_EAGER_PROLOGUE: Final = """\
    # HOT PATH (torch wrap off): a plain call of the selected provider. Installed as the
    # op class's __call__ (hence _self).
    if is_compiling():
        return torch_op(*args, **kwargs)
    if not loaded[0]:
        ensure_loaded()
    first = args[0] if args else None
    if isinstance(first, tensor):
        # is_cpu / is_cuda are cheap; Tensor.device builds an object (about 1 us)
        key = "CPU" if first.is_cpu else "CUDA" if first.is_cuda else keymap.get(
            first.device.type, "PrivateUse1")
    else:
        key = key_of(args, kwargs)
    holder = chains.get(key)
    if holder is None:
        return native(*args, **kwargs)"""


_PREDICATE: Final = """\
def predicate({params}):
    return _check({wanted})
"""

_CODE: dict[str, CodeType] = {}
"""Compiled template per variant (eager, kernel of each arity, predicate of each parameter
list), instantiated per op and key (per provider for predicates)."""

_DISK: list[bool] = [False]
"""Whether this process has read the on-disk copy of :data:`_CODE` yet."""


def _disk_path() -> Path:
    # compiling the variants a catalog needs takes milliseconds of start-up; like Python's
    # own bytecode cache, keep the code objects, keyed by interpreter and template text
    digest = hashlib.sha256("\0".join((_SELECT, _KERNEL_PROLOGUE, _EAGER_PROLOGUE,
                                        _PREDICATE, _DIRECT, _GUARD, _SIZED)).encode())
    return config.cache_dir() / "chooser" / (
        f"{sys.implementation.cache_tag}-{digest.hexdigest()[:16]}.marshal")


def _read_disk() -> None:
    _DISK[0] = True
    try:
        data = marshal.loads(_disk_path().read_bytes())
    except (OSError, ValueError, EOFError, TypeError):
        return  # none yet, or unreadable: compile again
    if isinstance(data, dict):
        _CODE.update({k: v for k, v in data.items()
                      if isinstance(k, str) and isinstance(v, CodeType) and k not in _CODE})


def _write_disk() -> None:
    # a read-only cache only costs the compile next time
    write_quietly(_disk_path(), marshal.dumps(dict(_CODE)))


def _module_code(variant: str, source: Callable[[], str]) -> CodeType:
    """The compiled text of ``variant``; ``source`` gives it, formatted only when neither this
    process nor the on-disk copy has compiled it yet."""
    code = _CODE.get(variant)
    if code is None and not _DISK[0]:
        _read_disk()
        code = _CODE.get(variant)
    if code is None:
        code = _CODE[variant] = compile(source(), f"<opmux chooser {variant}>", "exec")
        _write_disk()
    return code


def _body(variant: str, source: Callable[[], str]) -> CodeType:
    """The code of the one function ``variant`` defines (no instance is made)."""
    return next(c for c in _module_code(variant, source).co_consts if isinstance(c, CodeType))


def _compile(variant: str, source: Callable[[], str], env: dict[str, Any],
             name: str) -> Callable[..., Any]:
    """Instantiate ``variant`` in ``env`` (see :func:`_module_code`)."""
    code = _module_code(variant, source)
    namespace = dict(env)
    exec(code, namespace)  # defines the function; its body was compiled once
    fn: Callable[..., Any] = namespace[name]
    return fn


def make_kernel(name: str, holder: _KeyChain, native: Callable[..., Any], loaded: list[bool],
                ensure_loaded: Callable[[], None]) -> Callable[..., Any]:
    """The torch kernel of one key: walks ``holder``, falls back to ``native``; ``holder``
    keeps it, to give it the body of its shortcut (:meth:`_KeyChain.specialize`).

    For a plain native function the kernel takes its parameters by position (``a0, a1,
    ...`` with native's defaults): passing them on is then a plain call, cheaper than
    ``*args`` (the dispatcher never passes keywords; providers and predicates have native's
    parameters and defaults, checked at registration).
    """
    code = getattr(native, "__code__", None)
    params = "*args"
    if code is not None and not code.co_kwonlyargcount and not code.co_flags & 0x0C:
        params = ", ".join(f"a{i}" for i in range(code.co_argcount))  # no *args / **kwargs
    fixed = params != "*args"

    def source() -> str:
        return _SELECT.format(name="kernel", params=params, prologue=_KERNEL_PROLOGUE,
                              call=params, sized=f"holder.sized[{'a0' if fixed else 'args[0]'}"
                                                   f".numel().bit_length()]")

    env = {"holder": holder, "native": native, "loaded": loaded, "ensure_loaded": ensure_loaded}
    kernel = _compile(f"kernel/{params}", source, env, "kernel")
    if fixed:
        kernel.__defaults__ = getattr(native, "__defaults__", None)
    kernel.__name__ = kernel.__qualname__ = name
    # what the shortcut bodies fall back to: the general body, as a function of its own
    walk = types.FunctionType(kernel.__code__, kernel.__globals__, name, kernel.__defaults__)
    kernel.__globals__["walk"] = walk
    bodies = [kernel.__code__]
    for kind, template in (("direct", _DIRECT), ("guard", _GUARD), ("sized", _SIZED)):
        text = functools.partial(template.format, name="kernel", params=params, call=params,
                                 sized=f"sized[{'a0' if fixed else 'args[0]'}"
                                       f".numel().bit_length()]")
        bodies.append(_body(f"kernel-{kind}/{params}", text))
    holder.kernel, holder.loaded, holder.bodies = kernel, loaded, tuple(bodies)
    holder.specialize()
    return kernel


def make_eager(chains: dict[str, _KeyChain], native: Callable[..., Any], torch_op: Any,
               loaded: list[bool], ensure_loaded: Callable[[], None],
               is_compiling: Callable[[], bool], keymap: dict[str, str],
               key_of: Callable[..., str], tensor: type) -> Callable[..., Any]:
    """The eager ``__call__`` (torch wrap off): the device's key, then the same walk."""
    def source() -> str:
        return _SELECT.format(name="eager", params="_self, *args, **kwargs",
                              prologue=_EAGER_PROLOGUE, call="*args, **kwargs",
                              sized="holder.sized[first.numel().bit_length()] if isinstance("
                                    "first, tensor) else (None, None, None, holder.unsized)")

    return _compile("eager", source, {
        "chains": chains, "native": native, "torch_op": torch_op, "loaded": loaded,
        "ensure_loaded": ensure_loaded, "is_compiling": is_compiling, "keymap": keymap,
        "key_of": key_of, "tensor": tensor}, "eager")


def make_predicate(name: str, params: tuple[str, ...], wanted: tuple[str, ...],
                   check: Callable[..., bool]) -> Callable[..., bool]:
    """``def name(*params): return check(*wanted)`` as a plain function (each parameter list
    compiled once; ``_check`` must not be among ``params``)."""
    def source() -> str:
        return _PREDICATE.format(params=", ".join(params), wanted=", ".join(wanted))

    fn = _compile(f"predicate/{','.join(params)}/{','.join(wanted)}", source,
                  {"_check": check}, "predicate")
    fn.__code__ = fn.__code__.replace(co_name=name)  # named in tracebacks
    fn.__name__ = fn.__qualname__ = name
    return fn
