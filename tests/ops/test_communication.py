"""The communication ops in one process: size-1 groups, validation, fakes, compile,
providers. Real 2-rank collectives are in tests/layers/test_tensor_parallel_tp2.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import opmux
import opmux.distributed as od
from opmux.ops import all_gather, all_reduce, all_reduce_, reduce_scatter


@pytest.fixture(autouse=True)
def _no_group() -> Iterator[None]:
    od.destroy_tensor_parallel()
    yield
    od.destroy_tensor_parallel()


class _FakeGroup:
    """Stands in for a process group where only its size is read (fakes)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_comm_ops_are_catalog_ops() -> None:
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_reduce_"):
        op = opmux.get_op(name)
        assert getattr(opmux.ops, name) is op
        assert op.torch_op is getattr(torch.ops.opmux, name).default
        assert op.mutates_args == (("x",) if name == "all_reduce_" else ())
    assert "str group_name" in all_reduce.schema and "dim, str group_name" in all_gather.schema


@pytest.mark.parametrize("make", [
    lambda: torch.randn(5, 6),
    lambda: torch.randn(6, 5).t(),                # transposed
    lambda: torch.randn(4).expand(3, 4),          # stride 0
    lambda: torch.randn(20)[3:15].view(3, 4),     # offset view
    lambda: torch.randn(3, 4).to(torch.bfloat16),
], ids=["contig", "transposed", "stride0", "offset", "bf16"])
def test_size_one_group_is_a_copy(make: object) -> None:
    x = make()  # type: ignore[operator]
    before = x.clone()
    for out in (all_reduce(x, "tp"), all_gather(x, 0, "tp"), all_gather(x, -1, "tp"),
                reduce_scatter(x, 1, "tp")):
        assert torch.equal(out, x) and out.dtype == x.dtype
        assert out.is_contiguous() and out.data_ptr() != x.data_ptr()
    assert torch.equal(x, before)
    owned = x.contiguous()
    assert all_reduce_(owned, "tp") is None and torch.equal(owned, before)


def test_argument_errors_name_op_and_argument() -> None:
    with pytest.raises(opmux.OpInputError, match=r"all_gather \[native\]: argument 'dim': "
                       r"expected a dimension in \[-2, 2\) for shape \(3, 4\), got 2") as info:
        all_gather(torch.ones(3, 4), 2, "tp")
    assert info.value.argument == "dim"
    with pytest.raises(opmux.OpInputError, match="0-d tensor"):
        reduce_scatter(torch.tensor(1.0), 0, "tp")
    with pytest.raises(opmux.OpInputError, match=r"all_reduce_ \[native\]: argument 'x': "
                       r"expected a contiguous tensor"):
        all_reduce_(torch.ones(3, 4).t(), "tp")


def test_unknown_group_while_distributed_is_initialised_is_an_error() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(opmux.OpInputError, match=r"all_reduce \[native\]: argument "
                           r"'group_name': no process group named 'nope'") as info:
            all_reduce(torch.ones(2), "nope")
        assert isinstance(info.value, ValueError)
        # torch's own name for the world group works, as does opmux's after init
        world = dist.group.WORLD
        assert world is not None
        assert torch.equal(all_reduce(torch.ones(2), world.group_name), torch.ones(2))
        tp = od.init_tensor_parallel()
        assert (tp.world_size, tp.backend, tp.owns_process_group) == (1, "gloo", False)
        assert torch.equal(all_gather(torch.ones(2, 1), 1, "tp"), torch.ones(2, 1))
    finally:
        od.destroy_tensor_parallel()
        dist.destroy_process_group()


def test_fakes_use_the_group_size() -> None:
    od.register_group("fake4", _FakeGroup(4))  # type: ignore[arg-type]
    with FakeTensorMode():
        x = torch.empty(8, 6)
        assert all_reduce(x, "fake4").shape == (8, 6)
        assert all_gather(x, 1, "fake4").shape == (8, 24)
        assert reduce_scatter(x, 0, "fake4").shape == (2, 6)
        with pytest.raises(opmux.OpInputError, match="divisible by the 4 ranks"):
            reduce_scatter(x, 1, "fake4")


def test_fullgraph_compile_has_no_graph_break() -> None:
    from torch import _dynamo

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(x * 2, "tp")
        z = reduce_scatter(all_gather(y, 1, "tp"), 0, "tp")
        all_reduce_(z, "tp")
        return z + 1

    x = torch.randn(4, 3)
    _dynamo.reset()
    explained = _dynamo.explain(fn)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), x * 2 + 1)


def test_a_vendor_collective_wins_by_priority() -> None:
    op = opmux.ops.all_reduce

    def marked(x: torch.Tensor, group_name: str) -> torch.Tensor:
        return x + 10  # marks its output: the assertion shows which provider ran

    op.register_impl("test_marked", dispatch_key="CPU")(marked)
    try:
        x = torch.zeros(3)
        with op.set_priority(["test_marked", "native"]):
            assert op.dispatch(x, "tp").provider == "test_marked"
            assert torch.equal(op(x, "tp"), x + 10)
            compiled = torch.compile(lambda t: op(t, "tp"), fullgraph=True, backend="eager")
            assert torch.equal(compiled(x), x + 10)  # selection happens when the graph runs
        with op.set_priority(["native"]):
            assert torch.equal(op(x, "tp"), x)
    finally:
        op.unregister_impl("test_marked")


def test_a_vendor_in_place_collective_wins_by_priority() -> None:
    op = opmux.ops.all_reduce_

    def marked(x: torch.Tensor, group_name: str) -> None:
        x.add_(10)

    op.register_impl("test_marked_", dispatch_key="CPU")(marked)
    try:
        x = torch.zeros(3)
        with op.set_priority(["test_marked_", "native"]):
            op(x, "tp")
        assert torch.equal(x, torch.full((3,), 10.0))
    finally:
        op.unregister_impl("test_marked_")


@pytest.mark.parametrize("name", ["all_reduce", "all_gather", "reduce_scatter", "all_reduce_"])
def test_conformance_cases_and_opcheck(name: str) -> None:
    from opmux.testing import cases_for, run_opcheck

    cases = cases_for(name)
    assert len(cases) >= 5 and any("transposed" in c.name for c in cases)
    results = run_opcheck(name, cases=cases[:4])
    for per_case in results.values():
        assert set(per_case.values()) == {"SUCCESS"}, per_case
