"""The one-call decoder layer (``_LeanLayer.fused``, the CPU plugin's ``decoder_layer``):
the lean layers' logits to the bit, taken only while the ``cpp`` provider would serve every op
it stands for, and a refused argument handed to the ops, which say what is wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _hf_checkpoints import write_checkpoint
from torch import Tensor

import opmux
from opmux.models import Engine, ProviderTally, decoder, load_model
from opmux.models.decoder import AttentionBatch, CausalLM
from opmux.models.synthetic import LlamaShape, write_random_llama

SHAPE = LlamaShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=96)
PROMPTS = [[3, 7, 9, 1], [5, 1, 2, 8, 4, 7, 11, 30, 2, 6, 6]]
_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("llama"), SHAPE, seed=5)


@pytest.fixture
def model(ckpt: Path) -> CausalLM:
    model = load_model(ckpt)
    model.pack_weights()
    return model


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of each call of the one-call layer kernel in models packed from now on (every
    ``Engine`` packs its model anew)."""
    kernel = decoder._layer_kernel()
    assert kernel is not None
    rows: list[int] = []

    def counted(*args: Any) -> Any:
        rows.append(args[0].shape[0])
        return kernel(*args)

    monkeypatch.setattr(decoder, "_layer_kernel", lambda: counted)
    return rows


def _logits(model: CausalLM, prompts: list[list[int]], fused: bool) -> Tensor:
    """The logits of a prefill step and three decode steps, the decode steps through the
    one-call layers or (``fused=False``) through the lean layers' op calls."""
    engine = Engine(model, block_size=4)
    logits: list[Tensor] = []
    real = engine.forward_step

    def record(*args: Any) -> Tensor:
        out: Tensor = real(*args)
        logits.append(out)
        return out

    engine.forward_step = record  # type: ignore[method-assign]
    with pytest.MonkeyPatch.context() as mp:
        if not fused:
            mp.setattr("opmux.models.decoder._kernel_ops_first", lambda: False)
        engine.generate(prompts, 4)
    return torch.cat([x.flatten() for x in logits])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        not _BF16, reason="bfloat16 weights are packed on CPUs that compute in bfloat16"))])
@pytest.mark.parametrize("rows", [1, 2])
def test_one_call_layers_give_the_lean_layers_logits(tmp_path: Path, arch: str,
                                                     dtype: torch.dtype, rows: int,
                                                     seen: list[int]) -> None:
    """Llama and Qwen2 (QKV bias), float32 and bfloat16, decode steps of one and two rows:
    the one-call layers run every decode step and their logits are the op calls' to the bit
    (the prefill, of more rows, takes the op calls)."""
    write_checkpoint(arch, tmp_path)
    model = load_model(tmp_path, dtype)
    fused = _logits(model, PROMPTS[:rows], fused=True)
    assert seen == [rows] * (3 * len(model.layers))
    assert torch.equal(fused, _logits(model, PROMPTS[:rows], fused=False))


def test_more_rows_and_other_cache_formats_take_the_op_calls(ckpt: Path,
                                                            seen: list[int]) -> None:
    model = load_model(ckpt)
    Engine(model, block_size=4).generate([[1, 2], [3], [4, 5, 6]], 3)
    assert seen == []
    cache = model.new_kv_cache(2, 4, kv_cache_format="hnd")
    meta = AttentionBatch(torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32),
                          torch.tensor([1], dtype=torch.int32),
                          torch.tensor([0, 1], dtype=torch.int32), "hnd")
    with torch.inference_mode():
        model(torch.tensor([3]), torch.tensor([0]), cache, meta)
    assert seen == []


@pytest.fixture
def probe() -> Iterator[list[int]]:
    """A provider of ``rms_norm`` and ``fused_add_rms_norm`` on the CPU (native's result),
    registered for the test; yields the rows of its calls."""
    calls: list[int] = []

    def norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
        calls.append(x.shape[0])
        out: Tensor = opmux.ops.rms_norm.native(x, weight, eps)
        return out

    def add_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6
                 ) -> tuple[Tensor, Tensor]:
        calls.append(x.shape[0])
        out: tuple[Tensor, Tensor] = opmux.ops.fused_add_rms_norm.native(x, residual, weight,
                                                                          eps)
        return out

    opmux.ops.rms_norm.register_impl("layer_probe", dispatch_key="CPU")(norm)
    opmux.ops.fused_add_rms_norm.register_impl("layer_probe", dispatch_key="CPU")(add_norm)
    try:
        yield calls
    finally:
        opmux.ops.rms_norm.unregister_impl("layer_probe")
        opmux.ops.fused_add_rms_norm.unregister_impl("layer_probe")


def test_a_provider_put_first_is_called_instead(model: CausalLM, fresh_plugins: None,
                                                probe: list[int], seen: list[int]) -> None:
    """A provider put before ``cpp`` for one of the ops (here the norms) gets its calls in
    every step, and the one-call layers wait until it is no longer first."""
    engine = Engine(model, block_size=4)
    for op in (opmux.ops.rms_norm, opmux.ops.fused_add_rms_norm):
        op.set_default_priority(["layer_probe", "cpp", "native"])
    want = engine.generate(PROMPTS[:1], 3).outputs
    # two decode steps of one row: two norms per layer and the final one
    assert seen == [] and probe.count(1) == 2 * (2 * len(model.layers) + 1)
    with opmux.ops.silu_and_mul.set_priority(["native"]):
        for op in (opmux.ops.rms_norm, opmux.ops.fused_add_rms_norm):
            op.set_default_priority(["cpp", "native"])
        assert engine.generate(PROMPTS[:1], 3).outputs == want
        assert seen == []
    assert engine.generate(PROMPTS[:1], 3).outputs == want
    assert seen == [1] * (2 * len(model.layers))


def test_a_counting_tally_gets_the_op_calls(model: CausalLM, seen: list[int]) -> None:
    with ProviderTally(["paged_attention", "silu_and_mul"]) as tally:
        Engine(model, block_size=4).generate(PROMPTS[:1], 3)
    assert seen == []
    assert tally.calls() == {"paged_attention": {"cpp": 3 * len(model.layers)},
                             "silu_and_mul": {"cpp": 3 * len(model.layers)}}


def test_checked_ops_take_the_op_calls(model: CausalLM, fresh_plugins: None,
                                       seen: list[int]) -> None:
    with opmux.enable_output_checks():
        assert opmux.ops.rms_norm.first_choice("CPU") is None
        Engine(model, block_size=4).generate(PROMPTS[:1], 3)
    assert seen == []
    assert opmux.ops.rms_norm.first_choice("CPU").provider == "cpp"  # type: ignore[union-attr]


def _decode_row(model: CausalLM, positions: Tensor, slots: Tensor) -> None:
    """One decode step of one row at position 4 after a 4-token prefill."""
    cache = model.new_kv_cache(4, 4)
    table = torch.arange(2, dtype=torch.int32).view(1, 2)
    with torch.inference_mode():
        model(torch.tensor([3, 7, 9, 1]), torch.arange(4), cache,
              AttentionBatch(torch.arange(4), table, torch.tensor([4], dtype=torch.int32),
                             torch.tensor([0, 4], dtype=torch.int32)))
        model(torch.tensor([5]), positions, cache,
              AttentionBatch(slots, table, torch.tensor([5], dtype=torch.int32),
                             torch.tensor([0, 1], dtype=torch.int32)))


def test_refused_arguments_get_the_ops_errors(ckpt: Path, seen: list[int]) -> None:
    """What a kernel of the one-call layer refuses runs through the ops: their providers'
    predicates decline and native says what is wrong (or a provider's check does)."""
    model = load_model(ckpt)
    model.pack_weights()
    _decode_row(model, torch.tensor([4]), torch.tensor([4]))
    assert seen == [1] * len(model.layers)
    with pytest.raises(opmux.OpInputError, match=r"rotary_embedding.*positions"):
        _decode_row(model, torch.tensor([4000]), torch.tensor([4]))
    with pytest.raises(opmux.OpInputError, match=r"reshape_and_cache.*slot"):
        _decode_row(model, torch.tensor([4]), torch.tensor([99]))


def _kernel(step: Any, hidden: Tensor, positions: Tensor, cache: tuple[Tensor, Tensor],
            meta: AttentionBatch) -> tuple[Tensor, Tensor]:
    """``decoder_layer`` called directly for the first layer of the ``SHAPE`` model."""
    out: tuple[Tensor, Tensor] = step.kernel(
        hidden, None, step.norm1["weight"], step.eps1, step.norm2["weight"], step.eps2,
        step.qkv.rows(), None, step.o.rows(), step.gate_up.rows(), step.down.rows(), False,
        positions, step.rotary.cos_sin_cache, SHAPE.heads, SHAPE.kv_heads,
        SHAPE.hidden // SHAPE.heads, True, cache[0], cache[1], meta.slots, meta.block_tables,
        meta.seq_lens, meta.query_start_loc, 0.25, -1, 0.0)
    return out


def test_the_kernel_checks_distinct_slots_before_writing(model: CausalLM) -> None:
    """Two rows on one slot: ``decoder_layer`` refuses before it writes the cache (and the
    ops then give native's error)."""
    assert model._lean is not None
    step = model._lean[0]
    cache = model.new_kv_cache(2, 4)
    before = [c.clone() for c in cache[0]]
    meta = AttentionBatch(torch.tensor([1, 1]), torch.zeros(2, 1, dtype=torch.int32),
                          torch.tensor([2, 2], dtype=torch.int32),
                          torch.tensor([0, 1, 2], dtype=torch.int32))
    hidden = torch.randn(2, SHAPE.hidden)
    with torch.inference_mode(), pytest.raises(ValueError, match="distinct slots"):
        _kernel(step, hidden, torch.tensor([1, 1]), cache[0], meta)
    assert all(torch.equal(a, b) for a, b in zip(before, cache[0], strict=True))
    with torch.inference_mode(), pytest.raises(opmux.OpInputError, match="reshape_and_cache"):
        step.fused(hidden, None, torch.tensor([1, 1]), cache[0], meta)
    # caches whose blocks are one block repeated (stride 0): native refuses them
    shared = tuple(c[:1].expand_as(c) for c in cache[0])
    one = AttentionBatch(torch.tensor([1]), torch.zeros(1, 1, dtype=torch.int32),
                         torch.tensor([2], dtype=torch.int32),
                         torch.tensor([0, 1], dtype=torch.int32))
    with torch.inference_mode(), pytest.raises(ValueError, match="overlap"):
        _kernel(step, hidden[:1], torch.tensor([1]), shared, one)  # type: ignore[arg-type]
    with torch.inference_mode(), pytest.raises(opmux.OpInputError, match="overlap"):
        step.fused(hidden[:1], None, torch.tensor([1]), shared, one)  # type: ignore[arg-type]
    # a cache off the CPU: the ops decide (here native, which wants the query's device)
    meta_cache = tuple(torch.empty_like(c, device="meta") for c in cache[0])
    with torch.inference_mode(), pytest.raises(opmux.OpInputError, match="device"):
        step.fused(hidden[:1], None, torch.tensor([1]), meta_cache, one)  # type: ignore[arg-type]
