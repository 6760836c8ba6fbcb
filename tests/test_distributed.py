"""opmux.distributed: the named TP group, environment initialisation, errors, reset."""

from __future__ import annotations

import socket

import pytest
import torch

import opmux
import opmux.distributed as od

pytestmark = pytest.mark.usefixtures("fresh_distributed")


def test_uninitialised_is_a_size_one_group() -> None:
    assert not od.is_initialized()
    tp = od.get_tp_group()
    assert (tp.name, tp.rank, tp.world_size, tp.group) == ("tp", 0, 1, None)
    assert od.resolve_group("tp") is None


def test_divide_names_what_does_not_divide() -> None:
    assert od.divide(12, 4, "heads") == 3
    with pytest.raises(od.ParallelSizeError, match=r"^vocab size = 10 is not divisible by "
                       r"the tensor-parallel world size 4") as info:
        od.divide(10, 4, "vocab size")
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, opmux.OpmuxError)
    assert (err.what, err.numerator, err.denominator) == ("vocab size", 10, 4)
    assert repr(err).startswith("ParallelSizeError(")


def test_init_without_torchrun_environment_runs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tp = od.init_tensor_parallel()
    assert od.is_initialized() and (tp.world_size, tp.group) == (1, None)
    with pytest.raises(od.DistributedError, match="already initialised"):
        od.init_tensor_parallel()
    od.destroy_tensor_parallel()
    assert not od.is_initialized()


def test_incomplete_environment_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(od.DistributedError,
                       match=r"\['RANK', 'MASTER_ADDR', 'MASTER_PORT'\] are not"):
        od.init_tensor_parallel()
    assert not od.is_initialized()


def test_init_from_environment_owns_and_destroys_the_process_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for var, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        monkeypatch.setenv(var, value)
    tp = od.init_tensor_parallel(name="tp_env")
    try:
        assert dist.is_initialized() and tp.owns_process_group
        assert (tp.name, tp.rank, tp.world_size, tp.backend) == ("tp_env", 0, 1, "gloo")
        assert od.resolve_group("tp_env") is tp.group
        assert torch.equal(opmux.ops.all_reduce(torch.ones(3), "tp_env"), torch.ones(3))
    finally:
        od.destroy_tensor_parallel()
    assert not dist.is_initialized()  # opmux created it, opmux destroyed it
    with pytest.raises(od.DistributedError, match="does not divide the world size 1"):
        od.init_tensor_parallel(tensor_parallel_size=2)
    assert not dist.is_initialized() and not od.is_initialized()  # nothing left behind


def test_adopt_an_engine_group_and_register_more_names() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        tp = od.init_tensor_parallel(group, name="engine_tp")
        assert tp.group is group and not tp.owns_process_group
        assert od.get_tp_group() is tp and od.resolve_group("engine_tp") is group
        od.register_group("dp", group)
        od.register_group("dp", group)  # same group again: fine
        with pytest.raises(od.DistributedError, match="already registered as 'dp'"):
            od.register_group("dp", dist.new_group([0]))
        od.unregister_group("dp")
        with pytest.raises(od.DistributedError, match="tensor_parallel_size=2 but the given"):
            od.destroy_tensor_parallel()
            od.init_tensor_parallel(group, tensor_parallel_size=2)
        od.destroy_tensor_parallel()
        assert dist.is_initialized()  # the engine's group is the engine's to destroy
    finally:
        od.destroy_tensor_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("module", ["opmux.distributed", "opmux.layers.linear",
                                    "opmux.layers.embedding", "opmux.layers.logits"])
def test_doctests(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_public_access() -> None:
    assert opmux.distributed is od  # type: ignore[attr-defined]
    assert {"all_reduce", "all_gather", "reduce_scatter"} <= set(opmux.ops.__all__)
