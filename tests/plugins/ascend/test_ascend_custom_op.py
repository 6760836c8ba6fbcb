"""``mindspore_ops.advance_step_flashattn`` on MindSpore tensors against the native reference."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest
from ms_batches import native_result, random_batch, to_ms, to_np

import opmux
from opmux.plugins.ascend import mindspore_ops

pytestmark = [pytest.mark.mindspore, pytest.mark.slow]

ARGS = ("input_tokens", "sampled_token_ids", "input_positions", "seq_lens", "slot_mapping",
        "block_tables")


def call(num_seqs: int, num_queries: int, block_size: int, t: dict[str, Any]) -> None:
    mindspore_ops.advance_step_flashattn(num_seqs, num_queries, block_size, *(t[k] for k in ARGS))


def test_extension_built_for_cpu_backend(extension: ModuleType) -> None:
    from opmux.plugins.ascend import build

    assert build.backend() == "CPU"  # no CANN toolkit on this machine
    assert extension.HAS_ASCENDC is False
    assert str(build.build_dir("CPU")) in str(extension.__file__)


def test_worked_example_in_place(ms: ModuleType, extension: ModuleType) -> None:
    t = {
        "input_tokens": ms.Tensor(np.full(4, 77, np.int64)),
        "sampled_token_ids": ms.Tensor(np.array([[11], [12], [13], [14]], np.int64)),
        "input_positions": ms.Tensor(np.full(4, 77, np.int64)),
        "seq_lens": ms.Tensor(np.array([6, 8, 6, 6], np.int32)),
        "slot_mapping": ms.Tensor(np.full(4, 77, np.int64)),
        "block_tables": ms.Tensor(np.array([[0], [1], [2], [3]], np.int32)),
    }
    ids = {k: id(v) for k, v in t.items()}
    assert call(4, 4, 128, t) is None
    got = to_np(t)
    assert got["input_positions"].tolist() == [6, 8, 6, 6]
    assert got["seq_lens"].tolist() == [7, 9, 7, 7]
    assert got["slot_mapping"].tolist() == [6, 136, 262, 390]
    assert got["input_tokens"].tolist() == [11, 12, 13, 14]
    assert {k: id(v) for k, v in t.items()} == ids


@pytest.mark.parametrize(("num_seqs", "num_queries"), [(256, 256), (256, 200), (256, 1),
                                                       (7, 3), (1, 0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_batches_match_native(ms: ModuleType, extension: ModuleType, num_seqs: int,
                                     num_queries: int, seed: int) -> None:
    state = random_batch(num_seqs, num_queries, 32, max_blocks=16, seed=seed)
    want = native_result(num_seqs, num_queries, 32, state)
    t = to_ms(ms, state)
    call(num_seqs, num_queries, 32, t)
    got = to_np(t)
    for k in ARGS:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # padding rows: token 0, position 0, slot -1, seq_lens untouched
    assert (got["slot_mapping"][num_queries:] == -1).all()
    assert (got["input_tokens"][num_queries:] == 0).all()
    np.testing.assert_array_equal(got["seq_lens"][num_queries:], state["seq_lens"][num_queries:])


def test_repeated_steps_accumulate(ms: ModuleType, extension: ModuleType) -> None:
    state = random_batch(64, 60, 32, max_blocks=16, seed=3)
    state["seq_lens"][:] = np.arange(64, dtype=np.int32)
    t = to_ms(ms, state)
    for _ in range(5):
        call(64, 60, 32, t)
    want = state
    for _ in range(5):
        want = native_result(64, 60, 32, want)
    for k in ARGS:
        np.testing.assert_array_equal(to_np(t)[k], want[k], err_msg=k)


def test_outputs_of_earlier_ops_are_accepted(ms: ModuleType, extension: ModuleType) -> None:
    # an asynchronous op's output is a stub until resolved; the op must resolve it itself
    state = random_batch(16, 16, 32, max_blocks=4, seed=4)
    state["seq_lens"] = np.minimum(state["seq_lens"], 100)
    t = to_ms(ms, state)
    t["seq_lens"] = ms.ops.add(t["seq_lens"], ms.Tensor(np.ones(16, np.int32)))
    call(16, 16, 32, t)
    bumped = dict(state, seq_lens=state["seq_lens"] + 1)
    want = native_result(16, 16, 32, bumped)
    for k in ARGS:
        np.testing.assert_array_equal(to_np(t)[k], want[k], err_msg=k)


BAD_DTYPE = [("input_tokens", np.int32), ("sampled_token_ids", np.int32),
             ("input_positions", np.int32), ("seq_lens", np.int64), ("slot_mapping", np.int32),
             ("block_tables", np.int64), ("seq_lens", np.float32)]


@pytest.mark.parametrize(("name", "dtype"), BAD_DTYPE)
def test_wrong_dtype_raises_and_writes_nothing(ms: ModuleType, extension: ModuleType,
                                               name: str, dtype: type) -> None:
    state = random_batch(8, 6, 32, max_blocks=4, seed=5)
    state[name] = state[name].astype(dtype)
    t = to_ms(ms, state)
    with pytest.raises(opmux.OpInputError,
                       match=rf"opmux::advance_step_flashattn \(provider 'mindspore'\): "
                             rf"argument '{name}' expected dtype Int\d\d, got dtype"):
        call(8, 6, 32, t)
    for k in ARGS:
        np.testing.assert_array_equal(to_np(t)[k], state[k], err_msg=k)


@pytest.mark.parametrize(("num_seqs", "num_queries", "block_size", "change", "match"), [
    (9, 6, 32, None, r"argument 'input_tokens' expected shape \[9\] \(num_seqs\), got shape \[8\]"),
    (8, 9, 32, None, r"argument 'num_queries' expected 0 <= num_queries <= num_seqs \(8\), got 9"),
    (8, 6, 0, None, r"argument 'block_size' expected a positive int32, got 0"),
    (8, 6, 32, ("block_tables", lambda a: a[:5]), r"argument 'block_tables' expected shape "
     r"\[8, max_blocks\] \(num_seqs rows\), got shape \[5, 4\]"),
    (8, 6, 32, ("sampled_token_ids", lambda a: np.repeat(a, 2, axis=1)),
     r"argument 'sampled_token_ids' expected shape \[6, 1\]"),
    (8, 6, 32, ("seq_lens", lambda a: a.reshape(2, 4)),
     r"argument 'seq_lens' expected shape \[8\]"),
])
def test_bad_shapes_raise_and_write_nothing(ms: ModuleType, extension: ModuleType, num_seqs: int,
                                            num_queries: int, block_size: int, change: Any,
                                            match: str) -> None:
    state = random_batch(8, 6, 32, max_blocks=4, seed=6)
    if change is not None:
        state[change[0]] = np.ascontiguousarray(change[1](state[change[0]]))
    t = to_ms(ms, state)
    with pytest.raises(opmux.OpInputError, match=match):
        call(num_seqs, num_queries, block_size, t)
    for k in ARGS:
        np.testing.assert_array_equal(to_np(t)[k], state[k], err_msg=k)


def test_non_contiguous_state_raises(ms: ModuleType, extension: ModuleType) -> None:
    state = random_batch(8, 6, 32, max_blocks=4, seed=7)
    t = to_ms(ms, state)
    wide = ms.Tensor(np.zeros((8, 2), np.int64))
    t["slot_mapping"] = wide[:, 0]
    with pytest.raises(opmux.OpInputError, match=r"argument 'slot_mapping' expected a contiguous"):
        call(8, 6, 32, t)


def test_position_outside_block_table_detected_before_writing(ms: ModuleType,
                                                               extension: ModuleType) -> None:
    state = random_batch(8, 8, 32, max_blocks=4, seed=8)
    state["seq_lens"][3] = 4 * 32  # needs a fifth block
    t = to_ms(ms, state)
    # reported at the next synchronisation point (MindSpore runs PyNative ops asynchronously)
    with pytest.raises(RuntimeError, match=r"advance_step_flashattn: argument 'seq_lens' "
                                           r"expected values in \[0, 128\).*seq_lens\[3\] = 128"):
        call(8, 8, 32, t)
        to_np(t)
    ms.ops.add(t["seq_lens"], t["seq_lens"]).asnumpy()  # the pipeline keeps working afterwards
    for k in ARGS:
        np.testing.assert_array_equal(to_np(t)[k], state[k], err_msg=k)


def test_graph_mode_is_a_clear_error(ms: ModuleType, extension: ModuleType) -> None:
    state = random_batch(4, 4, 32, max_blocks=4, seed=9)
    t = to_ms(ms, state)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(opmux.ProviderUnavailableError,
                           match=r"runs in PyNative mode only .*GRAPH_MODE"):
            call(4, 4, 32, t)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    for k in ARGS:
        np.testing.assert_array_equal(to_np(t)[k], state[k], err_msg=k)


def test_empty_batch_is_a_no_op(ms: ModuleType, extension: ModuleType) -> None:
    state = random_batch(0, 0, 32, max_blocks=4, seed=10)
    t = to_ms(ms, state)
    call(0, 0, 32, t)
    assert to_np(t)["seq_lens"].shape == (0,)
