"""Every conformance case of the Triton kernels of the rotary, SSM and SSD modules, called
directly (interpreter on CPU, or a GPU), against native: the kernel declares the case
supported (strided and int32/int64 inputs are read in place), and its outputs and its writes
to float arguments (state caches) match native's on a second copy of the inputs."""

from __future__ import annotations

import importlib

import pytest
import torch
from cuda_refs import case_id, close, close_outputs

import opmux.ops
from opmux.plugins.cuda.triton_ops import KERNELS
from opmux.testing import Case, cases_for

pytestmark = pytest.mark.triton

REF_DEVICE = {"triton_ssd": "cpu"}
"""Where native runs per kernel module (default: the test device)."""

CASES = [(module, name, case) for name, (module, _) in KERNELS.items()
         if module in ("triton_ssd", "triton_ssm")
         or name in ("apply_rotary_emb", "dual_chunk_rotary_embedding")
         for case in cases_for(name)]


@pytest.mark.parametrize("module,name,case", CASES, ids=case_id)
def test_kernel_matches_native(device: torch.device, module: str, name: str,
                               case: Case) -> None:
    kernels = importlib.import_module(f"opmux.plugins.cuda.{module}")
    got_args, got_kw = case.materialize(device)
    want_args, want_kw = case.materialize(REF_DEVICE.get(module, device))
    assert getattr(kernels, f"{name}_supports")(*got_args, **got_kw), case.name
    got = getattr(kernels, name)(*got_args, **got_kw)
    want = getattr(opmux.ops, name).native(*want_args, **want_kw)
    dtype = case.tolerance_dtype() or torch.float32
    close_outputs(got, want, dtype)
    for g, w in zip(got_args, want_args, strict=True):  # the state caches
        if isinstance(g, torch.Tensor) and g.is_floating_point():
            close(g, w, dtype)
