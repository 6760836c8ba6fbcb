"""The forward context: which layers a forward pass may reach by name.

Some layers do work a compiler should not see through (data-dependent routing, vendor
kernels with state). Engines hide such a layer behind one op that takes the layer's
*name* (a string fits a torch schema; a module does not) and resolve the name when the
op executes, from a context the engine sets around each forward pass (vLLM's
``moe_forward_shared`` pattern):

>>> import torch, opmux
>>> from opmux.core.forward_context import forward_context, register_layer_op
>>> @register_layer_op("doc_shift", namespace="opmux_doc_ctx",
...                    fake=lambda layer_name, x: torch.empty_like(x))
... def shift(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
...     return x + layer.bias
>>> layer = torch.nn.Module()
>>> layer.bias = torch.ones(2)
>>> with forward_context(layers={"model.shift": layer}):
...     shift("model.shift", torch.zeros(2)).tolist()
[1.0, 1.0]

The context lives in a :class:`contextvars.ContextVar`: each thread (and asyncio task)
sees its own; a new thread starts with none. Nested contexts replace the outer one for
their block and restore it on exit. Under ``torch.compile`` the layer op is one opaque
node: the name is a constant in the graph and is resolved when the graph runs, so set
the context around the call of the compiled model, not inside it.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final, final

from opmux.core.errors import OpmuxError
from opmux.core.state import claim

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

    from opmux.core.op import Op
    from opmux.core.runners import ObjectOpOptions

__all__ = [
    "ForwardContext",
    "collect_layers",
    "forward_context",
    "get_forward_context",
    "leave_forward_context",
    "register_layer_op",
    "resolve_layer",
]


@final
class ForwardContext:
    """What one forward pass can reach: layers by name, plus free-form metadata.

    :ivar layers: read-only mapping of layer name → layer.
    :ivar metadata: whatever the engine attached (e.g. attention metadata), or ``None``.
    """

    __slots__ = ("layers", "metadata")

    def __init__(self, layers: Mapping[str, Any], metadata: Any = None) -> None:
        self.layers: Mapping[str, Any] = types.MappingProxyType(dict(layers))
        self.metadata = metadata

    def layer(self, name: str) -> Any:
        """The layer called ``name``.

        :raises OpmuxError: no such layer; the message lists the known names.
        """
        try:
            return self.layers[name]
        except KeyError:
            raise OpmuxError(
                f"layer {name!r} is not in the active forward context; known layers: "
                f"{sorted(self.layers)}. Pass it in forward_context(layers={{...}}) "
                f"(collect_layers(model) gathers every layer that has a layer_name)"
            ) from None

    def __repr__(self) -> str:
        return f"ForwardContext(layers={sorted(self.layers)})"


#: the open context; a module global because a context variable is per thread and task,
#: not per process
_CURRENT: Final[contextvars.ContextVar[ForwardContext | None]] = contextvars.ContextVar(
    "opmux_forward_context", default=None)


def leave_forward_context() -> None:
    """Leave any forward context the calling context still has open."""
    _CURRENT.set(None)


@contextlib.contextmanager
def forward_context(layers: Mapping[str, Any] | None = None,
                    metadata: Any = None) -> Iterator[ForwardContext]:
    """Make ``layers`` reachable by name for the ``with`` block (this thread only).

    :param layers: layer name → layer (see :func:`collect_layers`).
    :param metadata: anything the layers' ops need for this pass.
    :raises OpmuxError: a layer name is not a string.
    """
    table = dict(layers or {})
    bad = [name for name in table if not isinstance(name, str)]
    if bad:
        raise OpmuxError(f"forward_context: layer names must be strings, got {bad!r}")
    ctx = ForwardContext(table, metadata)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    """The active forward context of this thread.

    :raises OpmuxError: outside any ``with forward_context(...)`` block.
    """
    ctx = _CURRENT.get()
    if ctx is None:
        raise _no_context()
    return ctx


def _no_context(name: str | None = None) -> OpmuxError:
    what = f"layer {name!r} was requested but " if name is not None else ""
    return OpmuxError(
        f"{what}no forward context is active in this thread; wrap the forward pass in "
        f"'with opmux.forward_context(layers=collect_layers(model)):' (contexts are per "
        f"thread: a worker thread must enter its own)"
    )


def resolve_layer(name: str) -> Any:
    """The layer called ``name`` in the active forward context.

    :raises OpmuxError: no context is active, or it has no layer of that name.
    """
    # HOT PATH (layer ops): one ContextVar read and one dict access.
    ctx = _CURRENT.get()
    if ctx is None:
        raise _no_context(name)
    layers = ctx.layers
    if name in layers:
        return layers[name]
    return ctx.layer(name)  # raises with the known names


def collect_layers(model: torch.nn.Module, attr: str = "layer_name") -> dict[str, Any]:
    """Every submodule of ``model`` with a string attribute ``attr``, by that name.

    :raises OpmuxError: two submodules claim the same name.
    """
    found: dict[str, Any] = {}
    for path, module in model.named_modules():
        name = getattr(module, attr, None)
        if not isinstance(name, str):
            continue
        if claim(found, name, module) is not None:
            raise OpmuxError(
                f"collect_layers: two layers are named {name!r} (the second at "
                f"{path or '<root>'!r}); give each layer a unique {attr}")
    return found


def register_layer_op(
    name: str | None = None, **options: Unpack[ObjectOpOptions],
) -> Callable[[Callable[..., Any]], Op]:
    """Decorator: turn ``fn(layer, x: Tensor, ...)`` into an op ``(layer_name: str, x, ...)``.

    When the op executes, its kernel resolves ``layer_name`` in the active forward
    context and calls ``fn`` with the layer; outside a context, or for a name the
    context lacks, it raises :class:`~opmux.OpmuxError`.

    :param name: op name (default: the function's name).
    :param fake: shape function with the op's parameters, ``(layer_name, x, ...)``.
    :param mutates_args: names of Tensor parameters written in place.
    :param namespace: torch namespace of the op.
    :param registry: op registry (default: the global one).
    :raises SignatureMismatchError: ``fn`` has no leading layer parameter, or the fake's
        parameters differ from the op's.
    """
    from opmux.core.runners import _check_options, _object_op

    _check_options("register_layer_op", options)

    def decorator(fn: Callable[..., Any]) -> Op:
        return _object_op(fn, name=name, key_name="layer_name", key_type=str, table=None,
                          resolve=resolve_layer, **options)

    return decorator
