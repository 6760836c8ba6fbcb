"""The engine: paged cache bookkeeping, sampling, EOS, tokenizer prompts, provider tally."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from _hf_checkpoints import write_checkpoint
from torch import Tensor

import opmux
from opmux.cli import main
from opmux.core.tally import counting
from opmux.models import BlockAllocator, Engine, ProviderTally, SamplingParams, load_model
from opmux.models.decoder import AttentionBatch, CausalLM
from opmux.models.engine import sample
from opmux.models.synthetic import LlamaShape, write_random_llama
from opmux.plugins.registration import predicate

SHAPE = LlamaShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=96)
PROMPTS = [[3, 7, 9, 1], [5, 1, 2, 8, 4, 7, 11, 30, 2, 6, 6], [40]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("llama"), SHAPE, seed=3)


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> Engine:
    return Engine(load_model(ckpt), block_size=4)


def _dense_greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """Recompute the whole sequence every step (one prefill, fresh cache): no decode path."""
    seq, out = list(prompt), []
    for _ in range(n):
        tok = Engine(engine.model, block_size=64).generate([seq], 1).outputs[0][0]
        out.append(tok)
        seq.append(tok)
    return out


def test_batched_decode_equals_recomputing_each_sequence(engine: Engine) -> None:
    got = engine.generate(PROMPTS, 6).outputs
    assert got == [_dense_greedy(engine, p, 6) for p in PROMPTS]


def test_block_allocator_hands_out_and_takes_back() -> None:
    alloc = BlockAllocator(5)
    a, b = alloc.allocate(2), alloc.allocate(3)
    assert sorted(a + b) == [0, 1, 2, 3, 4] and alloc.num_free == 0
    with pytest.raises(opmux.OpmuxError, match="KV cache exhausted: 1 blocks asked for, 0 of 5"):
        alloc.allocate(1)
    alloc.free(a)
    assert alloc.num_free == 2 and sorted(alloc.allocate(2)) == sorted(a)


def test_seeded_sampling_repeats_and_seeds_differ(engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    one = engine.generate(PROMPTS, 8, params).outputs
    assert engine.generate(PROMPTS, 8, params).outputs == one
    other = engine.generate(PROMPTS, 8, SamplingParams(temperature=1.0, seed=8)).outputs
    assert other != one


def test_top_k_one_is_greedy(engine: Engine) -> None:
    greedy = engine.generate(PROMPTS, 5).outputs
    assert engine.generate(PROMPTS, 5, SamplingParams(temperature=0.7, top_k=1,
                                                      seed=1)).outputs == greedy


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(sample(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=0),
                        torch.Generator().manual_seed(i))) for i in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3


def test_sampling_params_out_of_range() -> None:
    with pytest.raises(opmux.ConfigError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_generation_stops_at_eos_and_frees_the_row(ckpt: Path, engine: Engine,
                                                   tmp_path: Path) -> None:
    free = engine.generate(PROMPTS, 6).outputs
    eos = free[1][2]  # the third token of the second prompt
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((ckpt / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    stopped = Engine(load_model(tmp_path), block_size=4).generate(PROMPTS, 6).outputs
    for full, cut in zip(free, stopped, strict=True):
        n = full.index(eos) + 1 if eos in full else len(full)
        assert cut == full[:n]
    assert len(stopped[1]) == 3
    ignoring = Engine(load_model(tmp_path), 4).generate(PROMPTS, 6,
                                                        SamplingParams(ignore_eos=True))
    assert ignoring.outputs == free
    # two places: prompt 2 is admitted when prompt 1 stops at EOS, and is prefilled in the
    # same ragged step as prompt 0's decode row, in the blocks prompt 1 gave back
    staged = Engine(load_model(tmp_path), block_size=4)
    seen: list[list[int]] = []
    original = staged.forward_step

    def spy(tokens: torch.Tensor, positions: torch.Tensor, cache: object, meta: object
            ) -> torch.Tensor:
        seen.append(positions.tolist())
        return original(tokens, positions, cache, meta)  # type: ignore[arg-type]

    staged.forward_step = spy  # type: ignore[method-assign]
    assert staged.generate(PROMPTS, 6, max_num_seqs=2).outputs == stopped
    assert seen[0] == [*range(4), *range(11)]  # prompts 0 and 1 prefilled together
    # prompt 1 stops at its third token (prefill, then decode steps at positions 4 and 5
    # for prompt 0): prompt 0's next decode row (position 6) and prompt 2's one-token
    # prompt (position 0) share the following step
    assert seen[1:4] == [[4, 11], [5, 12], [6, 0]]


def test_one_sequence_at_a_time_equals_all_at_once(engine: Engine) -> None:
    together = engine.generate(PROMPTS, 5).outputs
    assert engine.generate(PROMPTS, 5, max_num_seqs=1).outputs == together
    with pytest.raises(opmux.ConfigError, match="max_num_seqs"):
        engine.generate(PROMPTS, 5, max_num_seqs=0)


def test_bad_prompts(engine: Engine) -> None:
    with pytest.raises(opmux.ConfigError, match=r"token ids must be in \[0, 96\)"):
        engine.generate([[1, 96]], 2)
    with pytest.raises(opmux.ConfigError, match="at least one token"):
        engine.generate([[]], 2)
    with pytest.raises(opmux.ConfigError, match="max_position_embeddings"):
        engine.generate([[1]], 5000)


def test_provider_tally_counts_and_restores() -> None:
    op = opmux.ops.silu_and_mul
    before = type(op).__dict__["__call__"]
    assert not counting()
    with ProviderTally(["silu_and_mul", "rms_norm"]) as tally:
        assert counting()
        for _ in range(3):
            op(torch.ones(2, 8))
    assert type(op).__dict__["__call__"] is before and not counting()
    assert sum(tally.calls()["silu_and_mul"].values()) == 3
    assert "rms_norm" not in tally.providers()
    assert tally.providers()["silu_and_mul"] == op.dispatch(torch.ones(2, 8)).provider


def test_text_prompts_through_the_checkpoint_tokenizer(ckpt: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", *[f"w{i}" for i in range(1, 96)]])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((ckpt / name).read_bytes())
    tok.save(str(tmp_path / "tokenizer.json"))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w3 w7 w9 w1",
                 "--prompt-ids", "40", "--max-tokens", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = Engine(load_model(ckpt), 16).generate([[3, 7, 9, 1], [40]], 5).outputs
    assert report["outputs"] == expected
    assert report["text"][0] == " ".join(f"w{i}" if i else "<unk>" for i in expected[0])


def test_cli_errors(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(ckpt), "--prompt", "hello",
                 "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "--prompt needs" in err and "tokenizer.json" in err and "--prompt-ids" in err
    code = main(["generate", "--model", str(ckpt), "--max-tokens", "2"])
    assert code == 2 and "at least one --prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(ckpt), "--prompt-ids", "1,x", "--max-tokens", "2"])


def test_cli_text_report(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2,3",
                 "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[0] ") and "LlamaForCausalLM, float32, tp 1" in out
    assert "paged_attention" in out and "tokens/s" in out


def test_tp_launch_reports_a_failing_rank(ckpt: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    # the padded vocabulary (128) does not split over 3 ranks: every rank fails, none hangs
    code = main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-tokens", "2",
                 "--tp", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "[rank 0] exit 2" in err and "not divisible by the tensor-parallel" in err


def _kvfmt_probe(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, scale: float,
                 sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                 kv_cache_format: str = "canonical") -> torch.Tensor:
    """A paged_attention provider that reads only the 'hnd' format (native underneath)."""
    assert kv_cache_format == "hnd", kv_cache_format
    out: torch.Tensor = opmux.ops.paged_attention.native(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        sliding_window, soft_cap, kv_cache_format)
    return out


_kvfmt_probe_supports = predicate(_kvfmt_probe, lambda kv_cache_format: kv_cache_format == "hnd")


def test_engine_allocates_the_format_the_winning_provider_prefers(
        engine: Engine, fresh_plugins: None) -> None:
    want = engine.generate(PROMPTS, 5).outputs
    op = opmux.ops.paged_attention
    op.register_impl("engine_hnd_probe", dispatch_key="CPU",
                     supports_args=_kvfmt_probe_supports)(_kvfmt_probe)
    opmux.declare_kv_cache_formats("engine_hnd_probe", ["hnd"])
    model = engine.model
    with op.set_priority(["engine_hnd_probe", "native"]):
        assert model.kv_cache_format(4).name == "hnd"
        seen: list[str] = []
        real = model.new_kv_cache

        def spy(num_blocks, block_size, device=None,  # type: ignore[no-untyped-def]
                kv_cache_format="canonical"):
            seen.append(kv_cache_format)
            return real(num_blocks, block_size, device, kv_cache_format)

        model.new_kv_cache = spy  # type: ignore[method-assign]
        try:
            got = Engine(model, block_size=4).generate(PROMPTS, 5).outputs
        finally:
            del model.new_kv_cache
            op.unregister_impl("engine_hnd_probe")
    assert seen == ["hnd"]
    assert got == want


def test_packed_weights_give_the_layers_tokens_and_follow_weight_changes(ckpt: Path) -> None:
    packed, plain = load_model(ckpt), load_model(ckpt)
    fast, slow = Engine(packed, block_size=4), Engine(plain, block_size=4, pack_weights=False)
    before = fast.generate(PROMPTS, 6).outputs
    assert before == slow.generate(PROMPTS, 6).outputs
    for rows in (1, 2):  # the row kernel's row counts
        assert fast.generate(PROMPTS[:rows], 6).outputs == slow.generate(PROMPTS[:rows], 6).outputs
    with torch.no_grad():  # in place, after the copies were made: they must be made again
        for model in (packed, plain):
            model.lm_head.weight.mul_(-1.0)
            model.layers[0].mlp.down_proj.weight.mul_(0.5)
    after = fast.generate(PROMPTS, 6).outputs
    assert after == slow.generate(PROMPTS, 6).outputs and after != before
    Engine(packed, block_size=4, pack_weights=False)  # drops the copies
    assert Engine(packed, block_size=4, pack_weights=False).generate(PROMPTS, 6).outputs == after


def test_bfloat16_weights_are_packed_where_the_cpu_computes_in_bfloat16(ckpt: Path) -> None:
    packed = load_model(ckpt, torch.bfloat16)
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (packed.pack_weights() > 0) == bool(native_bf16)
    plain = load_model(ckpt, torch.bfloat16)
    fast, slow = Engine(packed, block_size=4), Engine(plain, block_size=4, pack_weights=False)
    for rows in (1, 2, len(PROMPTS)):
        assert fast.generate(PROMPTS[:rows], 6).outputs == slow.generate(PROMPTS[:rows], 6).outputs


def _logits_both_ways(model: CausalLM, prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
    """The logits of a prefill step and two decode steps, through the lean layers and
    through the layers' forwards (the same packed model, its lean layers set aside)."""
    results = []
    for lean in (True, False):
        engine = Engine(model, block_size=4)
        if not lean:
            model._lean = None
        logits: list[Tensor] = []
        real = engine.forward_step

        def record(*args: Any, real: Any = real, logits: list[Tensor] = logits) -> Tensor:
            out: Tensor = real(*args)
            logits.append(out)
            return out

        engine.forward_step = record  # type: ignore[method-assign]
        engine.generate(prompts, 3)
        results.append(torch.cat([x.flatten() for x in logits]))
    return results[0], results[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_layers_give_the_layers_logits(tmp_path: Path, arch: str,
                                            dtype: torch.dtype) -> None:
    """A packed Llama or Qwen2 (QKV bias) steps through its lean layers, and their logits are
    the layers' to the bit, prefill and decode, float32 and bfloat16."""
    write_checkpoint(arch, tmp_path)
    model = load_model(tmp_path, dtype)
    model.pack_weights()
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert model._lean is None  # no packed bfloat16 weights: nothing to step through
        return
    assert model._lean is not None and len(model._lean) == len(model.layers)
    lean, layers = _logits_both_ways(model, PROMPTS)
    assert torch.equal(lean, layers)


@pytest.mark.parametrize("arch", ["mixtral", "gemma2"])
def test_models_with_other_parts_have_no_lean_layers(tmp_path: Path, arch: str) -> None:
    write_checkpoint(arch, tmp_path)
    model = load_model(tmp_path)
    model.pack_weights()
    assert model._lean is None


def test_lean_layers_follow_the_layers_choices(ckpt: Path) -> None:
    """No lean layers where the layers would not run their catalog ops (custom ops off),
    without packed weights, or while autograd records (the layers' forwards run then)."""
    try:
        opmux.set_custom_ops("all,-rms_norm")
        off = load_model(ckpt)
        assert off.pack_weights() > 0 and off._lean is None
    finally:
        opmux.set_custom_ops(None)
    model = load_model(ckpt)
    model.pack_weights()
    assert model._lean is not None
    calls = []
    lean = type(model._lean[0])

    def counting(name: str) -> Any:
        step = getattr(lean, name)

        def counted(self: object, *args: object) -> object:
            calls.append(1)
            return step(self, *args)

        return counted

    with pytest.MonkeyPatch.context() as mp:
        for name in ("__call__", "fused"):  # the op calls, or one call per layer
            mp.setattr(lean, name, counting(name))
        Engine(model, block_size=4).generate(PROMPTS[:1], 2)
        assert len(calls) == 2 * len(model.layers)
        calls.clear()
        cache = model.new_kv_cache(4, 4)
        meta = AttentionBatch(torch.arange(4), torch.arange(1, dtype=torch.int32).view(1, 1),
                              torch.tensor([4], dtype=torch.int32),
                              torch.tensor([0, 4], dtype=torch.int32))
        with torch.enable_grad():  # weights without grad: the layers' forwards can run
            model.requires_grad_(False)(torch.tensor(PROMPTS[0]), torch.arange(4), cache, meta)
        assert calls == []
    model.pack_weights(False)
    assert model._lean is None


_ROW_KERNEL_RUN = """
import sys
import torch
from opmux.models import Engine, load_model
engine = Engine(load_model(sys.argv[1], getattr(torch, sys.argv[2])), block_size=4)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    engine.generate([[3, 7, 9, 1]], 3)
print(sorted({e.name for e in prof.events() if e.name.startswith("opmux_cpu::linear")}))
"""


@pytest.mark.parametrize("dtype", [
    "float32",
    pytest.param("bfloat16", marks=pytest.mark.skipif(
        not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        reason="bfloat16 weights are packed on CPUs that compute in bfloat16"))])
def test_a_fresh_process_decodes_single_rows_through_the_row_kernel(ckpt: Path,
                                                                   dtype: str) -> None:
    """The Engine is the first thing the process runs: packing starts opmux up, so the
    decode steps' linears reach the CPU plugin's row kernel (the profiler shows it): float32
    on the plain weight, bfloat16 on its copy."""
    run = subprocess.run([sys.executable, "-c", _ROW_KERNEL_RUN, str(ckpt), dtype],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "['opmux_cpu::linear_out']"



def test_a_float32_weight_with_strided_rows_gets_a_row_copy(ckpt: Path) -> None:
    """A float32 weight is read in place by the row kernel unless its rows are strided: then
    it gets a contiguous copy for the row kernel, and the tokens stay the layers'."""
    plain, strided = load_model(ckpt), load_model(ckpt)
    proj = strided.layers[0].mlp.down_proj
    with torch.no_grad():
        proj.weight.data = proj.weight.data.t().contiguous().t()
    assert proj.weight.stride(-1) != 1
    extra = proj.weight.numel() * proj.weight.element_size()
    assert strided.pack_weights() == plain.pack_weights() + extra
    want = Engine(load_model(ckpt), block_size=4, pack_weights=False).generate(PROMPTS[:1], 6)
    assert Engine(strided, block_size=4).generate(PROMPTS[:1], 6).outputs == want.outputs
