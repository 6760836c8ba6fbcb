"""Provider ``triton``: registers the Triton kernels of this package on an opmux registry.

The kernel modules (``triton_activation``, ``triton_norm``, ``triton_rope``, ``triton_cache``,
``triton_attention``, ...; one per op family) are imported here, inside :func:`register`, so
that the Triton interpreter choice (made when ``@triton.jit`` runs) follows the process state at
registration time. Without Triton installed the provider is registered as unsupported, with the
reason, so ``explain`` and ``opmux info`` say why it never runs."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any, Final

from opmux.core.errors import ProviderUnavailableError
from opmux.plugins.cuda.triton_runtime import PROVIDER, triton_status
from opmux.plugins.registration import RegistryLike, find_op

__all__ = ["KERNELS", "register"]

KERNELS: Final[dict[str, tuple[str, str | None]]] = {
    "silu_and_mul": ("triton_activation", "silu_and_mul_supports"),
    "gelu_and_mul": ("triton_activation", "gelu_and_mul_supports"),
    "rms_norm": ("triton_norm", "rms_norm_supports"),
    "fused_add_rms_norm": ("triton_norm", "fused_add_rms_norm_supports"),
    "rotary_embedding": ("triton_rope", "rotary_embedding_supports"),
    "reshape_and_cache": ("triton_cache", "reshape_and_cache_supports"),
    "paged_attention": ("triton_attention", "paged_attention_supports"),
    "advance_step_flashattn": ("triton_cache", "advance_step_flashattn_supports"),
    "fatrelu_and_mul": ("triton_activation", "fatrelu_and_mul_supports"),
    "mul_and_silu": ("triton_activation", "mul_and_silu_supports"),
    "gelu_and_mul_sparse": ("triton_activation", "gelu_and_mul_sparse_supports"),
    "swigluoai_and_mul": ("triton_activation", "swigluoai_and_mul_supports"),
    "gelu_new": ("triton_activation", "gelu_new_supports"),
    "gelu_fast": ("triton_activation", "gelu_fast_supports"),
    "quick_gelu": ("triton_activation", "quick_gelu_supports"),
    "relu2": ("triton_activation", "relu2_supports"),
    "xielu": ("triton_activation", "xielu_supports"),
    "apply_rotary_emb": ("triton_rope", "apply_rotary_emb_supports"),
    "dual_chunk_rotary_embedding": ("triton_rope", "dual_chunk_rotary_embedding_supports"),
    "causal_conv1d": ("triton_ssm", "causal_conv1d_supports"),
    "causal_conv1d_update": ("triton_ssm", "causal_conv1d_update_supports"),
    "selective_scan": ("triton_ssm", "selective_scan_supports"),
    "selective_state_update": ("triton_ssm", "selective_state_update_supports"),
    "gemma_rms_norm": ("triton_norm", "gemma_rms_norm_supports"),
    "gemma_fused_add_rms_norm": ("triton_norm", "gemma_fused_add_rms_norm_supports"),
    "rms_norm_gated": ("triton_norm", "rms_norm_gated_supports"),
    "quant_fp8": ("triton_quant", "quant_fp8_supports"),
    "encoder_attention": ("triton_attention", "encoder_attention_supports"),
    "concat_and_cache_mla": ("triton_attention", "concat_and_cache_mla_supports"),
    "mla_attention": ("triton_attention", "mla_attention_supports"),
    "ssd_chunk_scan": ("triton_ssd", "ssd_chunk_scan_supports"),
    "ssd_state_update": ("triton_ssd", "ssd_state_update_supports"),
}
"""Op name -> (kernel module in this package, name of its ``supports_args`` or None)."""


def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _unavailable(op_name: str, native: Callable[..., Any], reason: str) -> Callable[..., Any]:
    """A stand-in with native's signature that raises; used only when Triton is missing."""

    def impl(*args: Any, **kwargs: Any) -> Any:
        raise ProviderUnavailableError(f"{op_name} (provider {PROVIDER!r}): {reason}")

    impl.__signature__ = inspect.signature(native)  # type: ignore[attr-defined]
    impl.__name__ = op_name
    return impl


def register(registry: RegistryLike, dispatch_key: str = "CUDA") -> list[str]:
    """Register provider ``triton`` for every catalog op ``registry`` holds.

    :param registry: the registry (the global one from the plugin hook; tests pass their own).
    :param dispatch_key: torch dispatch key to serve: ``CUDA`` (CUDA and ROCm) in production,
        ``CPU`` in interpreter tests.
    :return: the ``op:provider`` pairs registered.
    """
    supported, reason = triton_status()
    have_triton = _have_triton()
    done: list[str] = []
    for op_name, (module_name, pred_name) in KERNELS.items():
        op = find_op(registry, op_name)
        if op is None:
            continue
        predicate: Callable[..., bool] | None = None
        if have_triton:
            module = importlib.import_module(f"opmux.plugins.cuda.{module_name}")
            fn = getattr(module, op_name)
            if pred_name is not None:
                predicate = getattr(module, pred_name)
        else:
            fn = _unavailable(op_name, op.impls["native"].fn, reason)
        op.register_impl(PROVIDER, dispatch_key=dispatch_key, supported=supported,
                         supports_args=predicate, reason=reason)(fn)
        done.append(f"{op_name}:{PROVIDER}")
    return done
