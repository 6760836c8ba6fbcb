"""Fixtures of the CUDA plugin tests.

Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. The
interpreter is chosen when ``@triton.jit`` runs, i.e. when a kernel module is first
imported, so it is switched on here, before any test module imports one.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

import opmux
import opmux.ops

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: the catalog ops the CUDA plugin serves
CATALOG = ("silu_and_mul", "gelu_and_mul", "rms_norm", "fused_add_rms_norm", "rotary_embedding",
           "reshape_and_cache", "paged_attention", "advance_step_flashattn")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels run: the GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def triton_ops_in(registry: opmux.OpRegistry, ns: str,
                  device: torch.device) -> Callable[[Iterable[str]], dict[str, opmux.Op]]:
    """Registers the natives of the named catalog ops in the test's fresh registry and
    namespace, with provider ``triton`` registered for the key of ``device`` (``CPU`` under
    the interpreter) and put first; returns them by name."""

    def make(names: Iterable[str]) -> dict[str, opmux.Op]:
        from opmux.plugins.cuda import triton_ops

        ops = {}
        for name in names:
            src = getattr(opmux.ops, name)
            ops[name] = registry.register_op(src.native, name=name, namespace=ns,
                                             mutates_args=src.mutates_args)
        done = triton_ops.register(registry, "CUDA" if device.type == "cuda" else "CPU")
        assert sorted(done) == sorted(f"{n}:triton" for n in ops)
        for op in ops.values():
            op.set_default_priority(["triton", "native"])
        return ops

    return make


@pytest.fixture
def triton_catalog(triton_ops_in: Callable[[Iterable[str]], dict[str, opmux.Op]]
                   ) -> dict[str, opmux.Op]:
    """The catalog ops of :data:`CATALOG` with provider ``triton`` first."""
    return triton_ops_in(CATALOG)


@pytest.fixture(scope="module")
def k(request: pytest.FixtureRequest) -> Any:
    """The Triton kernel module named by the test module's ``KERNELS``."""
    return importlib.import_module(f"opmux.plugins.cuda.{request.module.KERNELS}")
