"""Provider ``mindspore``: torch tensors through DLPack into the MindSpore op, against native."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from ms_batches import native_result, random_batch

import opmux
from opmux.plugins import ascend as ascend_plugin

pytestmark = [pytest.mark.mindspore, pytest.mark.slow]

ARGS = ("input_tokens", "sampled_token_ids", "input_positions", "seq_lens", "slot_mapping",
        "block_tables")


@pytest.fixture
def provider(extension: ModuleType) -> ModuleType:
    from opmux.plugins.ascend import dlpack_provider

    return dlpack_provider


def torch_state(state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()) for k, v in state.items()}


@pytest.mark.parametrize(("num_seqs", "num_queries"), [(256, 256), (256, 131), (4096, 4000)])
def test_matches_native(provider: ModuleType, num_seqs: int, num_queries: int) -> None:
    state = random_batch(num_seqs, num_queries, 32, max_blocks=32, seed=num_queries)
    want = native_result(num_seqs, num_queries, 32, state)
    t = torch_state(state)
    ptrs = {k: v.data_ptr() for k, v in t.items()}
    provider.advance_step_flashattn(num_seqs, num_queries, 32, *(t[k] for k in ARGS))
    for k in ARGS:
        np.testing.assert_array_equal(t[k].numpy(), want[k], err_msg=k)
    assert {k: v.data_ptr() for k, v in t.items()} == ptrs  # updated where they live


def test_views_share_memory_both_ways(provider: ModuleType) -> None:
    t = torch.arange(6, dtype=torch.int64)
    view = provider.to_mindspore(t)
    assert view.asnumpy().tolist() == [0, 1, 2, 3, 4, 5]
    t[2] = 42
    assert view.asnumpy()[2] == 42
    assert provider.to_mindspore(t) is view  # cached while t lives and keeps its storage


def test_view_cache_follows_storage_and_lifetime(provider: ModuleType) -> None:
    gc.collect()
    before = provider.cached_view_count()
    t = torch.zeros(4, dtype=torch.int64)
    first = provider.to_mindspore(t)
    t.set_(torch.ones(8, dtype=torch.int64))  # new storage: the old view must not be reused
    second = provider.to_mindspore(t)
    assert second is not first
    assert second.asnumpy().tolist() == [1] * 8
    assert provider.cached_view_count() == before + 1  # t's entry, made anew for its storage
    del t, first, second
    gc.collect()
    assert provider.cached_view_count() == before


def test_repeated_steps_on_persistent_buffers(provider: ModuleType) -> None:
    state = random_batch(128, 120, 16, max_blocks=64, seed=11)
    state["seq_lens"][:] = np.arange(128, dtype=np.int32)
    t = torch_state(state)
    want = state
    for step in range(6):
        t["sampled_token_ids"].fill_(step)
        want = dict(want, sampled_token_ids=np.full((120, 1), step, np.int64))
        provider.advance_step_flashattn(128, 120, 16, *(t[k] for k in ARGS))
        want = native_result(128, 120, 16, want)
        for k in ARGS:
            np.testing.assert_array_equal(t[k].numpy(), want[k], err_msg=f"step {step}: {k}")


@pytest.mark.parametrize(("name", "dtype"), [("seq_lens", torch.int64),
                                             ("input_tokens", torch.int32),
                                             ("block_tables", torch.int64)])
def test_wrong_dtype_raises_and_writes_nothing(provider: ModuleType, name: str,
                                               dtype: torch.dtype) -> None:
    state = random_batch(8, 8, 32, max_blocks=4, seed=12)
    t = torch_state(state)
    t[name] = t[name].to(dtype)
    before = {k: v.clone() for k, v in t.items()}
    args = [t[k] for k in ARGS]
    # the provider declines; through the op, native's check says why
    assert not provider.advance_step_flashattn_supports(8, 8, 32, *args)
    with pytest.raises(opmux.OpInputError, match=rf"provider 'native'\): argument '{name}' "
                                                 rf"expected dtype"):
        opmux.get_op("advance_step_flashattn").native(8, 8, 32, *args)
    for k in ARGS:
        assert torch.equal(t[k], before[k]), k


def test_out_of_table_position_raises_and_writes_nothing(provider: ModuleType) -> None:
    state = random_batch(8, 8, 32, max_blocks=4, seed=13)
    state["seq_lens"][5] = 200
    t = torch_state(state)
    # index values are data: the kernel checks them before it writes anything
    assert provider.advance_step_flashattn_supports(8, 8, 32, *(t[k] for k in ARGS))
    with pytest.raises(opmux.OpInputError, match=r"provider 'mindspore'\): argument 'seq_lens' "
                                                 r"expected values in \[0, 128\).*"
                                                 r"seq_lens\[5\] = 200"):
        provider.advance_step_flashattn(8, 8, 32, *(t[k] for k in ARGS))
    for k in ARGS:
        np.testing.assert_array_equal(t[k].numpy(), state[k], err_msg=k)


def test_conformance_kit(provider: ModuleType, ns: str, registry: Any) -> None:
    from opmux.testing import check_provider
    from opmux.testing.cases import cases_for

    native = opmux.get_op("advance_step_flashattn").impls["native"].fn
    op = registry.register_op(native, name="advance_step_flashattn", namespace=ns,
                              mutates_args=("input_tokens", "input_positions", "seq_lens",
                                            "slot_mapping"))
    assert provider.register(registry) == ["advance_step_flashattn:mindspore"]
    assert op.impls["mindspore"].supported, op.impls["mindspore"].reason
    report = check_provider(op, "mindspore", cases=cases_for("advance_step_flashattn"))
    assert report.ok, report.format()
    assert report.counts["pass"] >= 5


def test_dispatch_selects_provider_by_priority(provider: ModuleType, ns: str,
                                               registry: Any) -> None:
    native = opmux.get_op("advance_step_flashattn").impls["native"].fn
    op = registry.register_op(native, name="advance_step_flashattn", namespace=ns,
                              mutates_args=("input_tokens", "input_positions", "seq_lens",
                                            "slot_mapping"))
    provider.register(registry)
    state = random_batch(16, 12, 32, max_blocks=4, seed=14)
    t = torch_state(state)
    args = (16, 12, 32, *(t[k] for k in ARGS))
    with op.set_priority(["mindspore", "native"]):
        assert op.dispatch(*args).provider == "mindspore"
        op(*args)
    want = native_result(16, 12, 32, state)
    for k in ARGS:
        np.testing.assert_array_equal(t[k].numpy(), want[k], err_msg=k)
    t["seq_lens"] = t["seq_lens"].long()  # declined by supports_args: native takes it
    with op.set_priority(["mindspore", "native"]):
        assert op.dispatch(16, 12, 32, *(t[k] for k in ARGS)).provider == "native"


@pytest.fixture
def hook_registry(ns: str, registry: Any) -> Iterator[Any]:
    native = opmux.get_op("advance_step_flashattn").impls["native"].fn
    op = registry.register_op(native, name="advance_step_flashattn", namespace=ns,
                              mutates_args=("input_tokens", "input_positions", "seq_lens",
                                            "slot_mapping"))
    yield SimpleNamespace(list_ops=lambda: [op], op=op)


def test_plugin_hooks_register_on_cpu(extension: ModuleType, hook_registry: Any) -> None:
    assert ascend_plugin.opmux_plugin_info() == {"name": "ascend", "platforms": ["ascend", "cpu"]}
    cpu = SimpleNamespace(name="cpu")
    ascend_plugin.opmux_register(registry=hook_registry, platform=cpu)
    impl = hook_registry.op.impls["mindspore"]
    assert impl.dispatch_key == "CPU" and impl.supported
    assert ascend_plugin.opmux_default_priority("advance_step_flashattn", cpu) is None
    assert ascend_plugin.opmux_default_priority(
        "advance_step_flashattn", SimpleNamespace(name="ascend")) == ["mindspore", "native"]
    assert ascend_plugin.opmux_default_priority("rms_norm", SimpleNamespace(name="ascend")) is None


def test_failed_build_registers_unsupported_with_reason(provider: ModuleType,
                                                        hook_registry: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from opmux.plugins.ascend import build

    monkeypatch.setattr(build, "build_status", lambda: (False, "g++: not found"))
    assert provider.register(hook_registry) == ["advance_step_flashattn:mindspore"]
    impl = hook_registry.op.impls["mindspore"]
    assert (impl.supported, impl.reason) == (False, "g++: not found")


def test_plugin_module_does_not_import_mindspore() -> None:
    code = ("import sys, opmux.plugins.ascend as p; p.opmux_plugin_info(); "
            "import opmux.plugins.ascend.mindspore_ops, opmux.plugins.ascend.build; "
            "print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_views_of_dead_tensors_are_released(provider: ModuleType) -> None:
    gc.collect()
    before = provider.cached_view_count()
    for seed in range(20):
        t = torch_state(random_batch(8, 8, 32, max_blocks=4, seed=seed))
        provider.advance_step_flashattn(8, 8, 32, *(t[k] for k in ARGS))
    del t
    gc.collect()
    assert provider.cached_view_count() <= before
