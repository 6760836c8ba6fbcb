"""Sizes from users are range-checked, and what they imply is compared with the memory
available before it is allocated."""

from __future__ import annotations

import pytest

import opmux
from opmux.models import Engine, MemoryBudgetError, SamplingParams, load_model, memory
from opmux.models.synthetic import LlamaShape, write_random_llama

SHAPE = LlamaShape(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=48, vocab=64)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine(load_model(write_random_llama(tmp_path_factory.mktemp("m"), SHAPE)), 4)


def test_a_kv_cache_that_does_not_fit_is_refused_with_its_size(engine: Engine) -> None:
    big = Engine(engine.model, 60_000)
    with pytest.raises(MemoryBudgetError, match=(
            r"generate: KV cache of .* MB \(1 blocks of block_size 60000 for 1 sequence.*"
            r"does not fit the .* available on cpu; lower the block size")) as info:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(memory, "available_bytes", lambda device=None: 10**6)
            big.generate([[1, 2]], 3)
    assert info.value.what == "KV cache" and info.value.available == 10**6
    assert isinstance(info.value, MemoryError) and isinstance(info.value, opmux.OpmuxError)


def test_the_real_limit_is_read(engine: Engine) -> None:
    available = memory.available_bytes()
    assert available is None or available > 0
    assert engine.generate([[1, 2]], 2).outputs[0]  # small sizes pass the check


@pytest.mark.parametrize(("block_size", "message"), [
    (0, r"block_size expected an int in \[1, 65536\], got 0"),
    (True, r"block_size expected an int in \[1, 65536\], got bool True"),
    (10**8, r"block_size expected an int in \[1, 65536\], got 100000000"),
    (4.0, "got float 4.0"),
])
def test_engine_block_size(engine: Engine, block_size: object, message: str) -> None:
    with pytest.raises(opmux.ConfigError, match=message):
        Engine(engine.model, block_size)  # type: ignore[arg-type]


@pytest.mark.parametrize(("prompts", "max_tokens", "message"), [
    ([[1, 1.7]], 2, r"and integers, got 1\.7 \(prompt 0, position 1\)"),
    ([[True]], 2, "got True"),
    ([[1]], -1, r"max_tokens expected an int in \[0, "),
    ([[1]], 2.5, "max_tokens expected an int"),
])
def test_engine_prompts_and_counts(engine: Engine, prompts: list[list[object]],
                                   max_tokens: object, message: str) -> None:
    with pytest.raises(opmux.ConfigError, match=message):
        engine.generate(prompts, max_tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "message"), [
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, r"top_k expected an int in \[0, "),
    ({"seed": 2**64}, r"seed expected an int in \[0, 9223372036854775807\]"),
    ({"seed": -1}, "seed expected"),
])
def test_sampling_params(fields: dict[str, object], message: str) -> None:
    with pytest.raises(opmux.ConfigError, match=message):
        SamplingParams(**fields)  # type: ignore[arg-type]
