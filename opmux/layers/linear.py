"""Linear layers, replicated and tensor-parallel (vLLM 0.32 contract, DESIGN §7 and §9).

Classes, constructor arguments, parameter names (``weight`` ``[out, in]``, ``bias``) and
forward results follow vLLM's ``vllm.model_executor.layers.linear``: ``forward`` returns
``(output, output_bias)`` where ``output_bias`` is the bias when ``skip_bias_add`` (the
caller adds it), else ``None``; with ``return_bias=False`` it returns ``output`` alone.

Sharding follows the TP group of :mod:`opmux.distributed` read at construction:
:class:`ColumnParallelLinear` keeps rows ``[rank·out/tp, (rank+1)·out/tp)`` of the weight
(its outputs are this rank's slice; ``gather_output`` all-gathers them),
:class:`RowParallelLinear` keeps columns of the input dimension and all-reduces partial
sums (``reduce_results``). Communication goes through the catalog ops
:func:`~opmux.ops.communication.all_gather` / :func:`~opmux.ops.communication.all_reduce_`
(in place, on the layer's own fresh partial output), so a vendor's collective serves the
layers. Every ``weight_loader(param, loaded_weight
[, loaded_shard_id])`` takes the FULL checkpoint tensor and keeps this rank's shard.

Differences from vLLM: ``quant_config`` must be ``None`` (a config raises
:class:`opmux.ConfigError`; weights are unquantized), ``prefix`` is stored only, and the
``tp_rank`` / ``tp_size`` overrides and ``weight_loader_v2`` are not provided. Weights
are allocated uninitialised, as in vLLM: load them before use.

>>> import torch
>>> from opmux.layers import ColumnParallelLinear
>>> layer = ColumnParallelLinear(4, 6, bias=False)
>>> layer.weight_loader(layer.weight, torch.eye(6, 4))
>>> out, bias = layer(torch.ones(2, 4))
>>> tuple(out.shape), bias is None
((2, 6), True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import Parameter

from opmux.core.errors import ConfigError, OpInputError
from opmux.distributed import ParallelSizeError, divide
from opmux.layers._argument_checks import check_size
from opmux.layers._gemm import dense_linear
from opmux.layers._tensor_parallel import (
    copy_checked,
    load_rank_slice,
    narrow_full,
    new_param,
    reject_quant_config,
    tp_coords,
)
from opmux.layers.custom_op import CustomOp
from opmux.ops.communication import all_gather, all_reduce_

__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "dense_linear",
]

LinearOutput = Tensor | tuple[Tensor, Parameter | None]
"""``output``, or ``(output, output_bias)`` when the layer returns its bias."""


class LinearBase(CustomOp):
    """What every linear layer holds: sizes, bias policy, dtype and TP coordinates.

    :ivar tp_rank: this rank in the TP group (0 with ``disable_tp``).
    :ivar tp_size: the TP world size (1 with ``disable_tp``).
    :ivar tp_group_name: the group the communication ops use.
    """

    weight: Parameter
    bias: Parameter | None

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: Any = None, prefix: str = "", *, return_bias: bool = True,
                 disable_tp: bool = False) -> None:
        super().__init__()
        reject_quant_config(type(self).__name__, quant_config)
        self.input_size = input_size
        self.output_size = output_size
        self.has_bias = bias
        self.skip_bias_add = skip_bias_add
        self.params_dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.quant_config = None
        self.prefix = prefix
        self.return_bias = return_bias
        self.disable_tp = disable_tp
        self.tp_rank, self.tp_size, self.tp_group_name = tp_coords(disable_tp)

    def _new_param(self, *shape: int, **attrs: Any) -> Parameter:
        return new_param(self.params_dtype, self.weight_loader, *shape, **attrs)

    def weight_loader(self, param: Parameter, loaded_weight: Tensor) -> None:
        raise NotImplementedError

    def _result(self, output: Tensor) -> LinearOutput:
        if not self.return_bias:
            return output
        return output, (self.bias if self.skip_bias_add else None)


@CustomOp.register("replicated_linear")
class ReplicatedLinear(LinearBase):
    """``y = x Wᵀ + b`` with the full weight on every rank.

    :param input_size: in features.
    :param output_size: out features.
    :param bias: add a bias.
    :param skip_bias_add: return the bias instead of adding it.
    :param params_dtype: parameter dtype (default: torch's default dtype).
    :param return_bias: return ``(output, output_bias)`` (default) or ``output``.
    :param disable_tp: accepted for vLLM compatibility (no effect here).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: Any = None, prefix: str = "", *, return_bias: bool = True,
                 disable_tp: bool = False) -> None:
        super().__init__(input_size, output_size, bias, skip_bias_add, params_dtype,
                         quant_config, prefix, return_bias=return_bias, disable_tp=disable_tp)
        self.output_partition_sizes = [output_size]
        self.weight = self._new_param(output_size, input_size, input_dim=1, output_dim=0)
        self.bias = self._new_param(output_size, output_dim=0) if bias else None

    def weight_loader(self, param: Parameter, loaded_weight: Tensor) -> None:
        """Copy the full tensor (shapes must match)."""
        copy_checked(type(self).__name__, param.data, loaded_weight)

    def forward_native(self, x: Tensor) -> LinearOutput:
        bias = None if self.skip_bias_add else self.bias
        return self._result(dense_linear(x, self.weight, bias))

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, output_features={self.output_size}, "
                f"bias={self.bias is not None}")


@CustomOp.register("column_parallel_linear")
class ColumnParallelLinear(LinearBase):
    """``Y = X A + b`` with ``A`` split along its output dimension across TP ranks.

    :param input_size: in features.
    :param output_size: out features (all ranks together); divisible by the TP size.
    :param bias: add a bias (sharded like the output).
    :param gather_output: all-gather the output so every rank has all ``output_size``
        features; otherwise each rank returns its ``output_size / tp`` slice.
    :param skip_bias_add: return the bias instead of adding it.
    :param params_dtype: parameter dtype.
    :param return_bias: return ``(output, output_bias)`` (default) or ``output``.
    :param disable_tp: do not shard (a replicated layer of this class).
    :raises opmux.distributed.ParallelSizeError: the TP size does not divide an output size.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, quant_config: Any = None,
                 prefix: str = "", *, return_bias: bool = True,
                 disable_tp: bool = False) -> None:
        super().__init__(input_size, output_size, bias, skip_bias_add, params_dtype,
                         quant_config, prefix, return_bias=return_bias, disable_tp=disable_tp)
        name = type(self).__name__
        self.gather_output = gather_output
        self.input_size_per_partition = input_size
        sizes: list[int] | None = getattr(self, "output_sizes", None)
        if sizes is not None:  # merged / QKV: each part is sharded on its own
            self.output_partition_sizes = [divide(s, self.tp_size, f"{name} output_sizes[{i}]")
                                           for i, s in enumerate(sizes)]
        self.output_size_per_partition = divide(output_size, self.tp_size,
                                                f"{name} output_size")
        if sizes is None:
            self.output_partition_sizes = [self.output_size_per_partition]
        self.weight = self._new_param(sum(self.output_partition_sizes), input_size,
                                      input_dim=1, output_dim=0)
        self.bias = (self._new_param(self.output_size_per_partition, output_dim=0)
                     if bias else None)

    def weight_loader(self, param: Parameter, loaded_weight: Tensor) -> None:
        """Keep this rank's rows of the full tensor (``output_dim``); copy others whole."""
        dim = getattr(param, "output_dim", None)
        load_rank_slice(type(self).__name__, param, loaded_weight, dim, self.tp_rank, self.tp_size)

    def forward_native(self, input_: Tensor) -> LinearOutput:
        bias = None if self.skip_bias_add else self.bias
        output = dense_linear(input_, self.weight, bias)
        if self.gather_output and self.tp_size > 1:
            output = all_gather(output, -1, self.tp_group_name)
        return self._result(output)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, "
                f"output_features={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}, "
                f"gather_output={self.gather_output}")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections packed along the output (e.g. gate and up).

    Each part is sharded on its own: this rank's weight is
    ``[part0 shard; part1 shard; ...]``. ``weight_loader(param, full, loaded_shard_id)``
    takes part ``loaded_shard_id`` (an int) in full, or with ``None`` the parts fused on
    disk (a tuple of consecutive ids: those parts fused).

    :param output_sizes: out features of each part; each divisible by the TP size.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, quant_config: Any = None,
                 prefix: str = "", *, return_bias: bool = True,
                 disable_tp: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, gather_output, skip_bias_add,
                         params_dtype, quant_config, prefix, return_bias=return_bias,
                         disable_tp=disable_tp)

    def _check_shard_id(self, shard_id: object) -> None:
        n = len(self.output_sizes)
        ok = (shard_id is None or (isinstance(shard_id, int) and 0 <= shard_id < n)
              or (isinstance(shard_id, tuple) and len(shard_id) > 0
                  and all(isinstance(i, int) and 0 <= i < n for i in shard_id)
                  and list(shard_id) == list(range(shard_id[0], shard_id[0] + len(shard_id)))))
        if not ok:
            raise OpInputError(
                f"{type(self).__name__}.weight_loader: argument 'loaded_shard_id': expected "
                f"None, an int in [0, {n}) or a tuple of consecutive such ints, got "
                f"{shard_id!r}", op=type(self).__name__, argument="loaded_shard_id")

    def weight_loader(self, param: Parameter, loaded_weight: Tensor,  # type: ignore[override]
                      loaded_shard_id: int | tuple[int, ...] | None = None) -> None:
        self._check_shard_id(loaded_shard_id)
        name = type(self).__name__
        dim = getattr(param, "output_dim", None)
        if dim is None:
            copy_checked(name, param.data, loaded_weight)
            return
        if loaded_shard_id is None or isinstance(loaded_shard_id, tuple):
            ids = (range(len(self.output_sizes)) if loaded_shard_id is None
                   else loaded_shard_id)
            sizes = [self.output_sizes[i] for i in ids]
            parts = narrow_full(name, loaded_weight, dim, sum(sizes), 0, sum(sizes))
            for shard_id, part in zip(ids, parts.split(sizes, dim), strict=True):
                self.weight_loader(param, part, shard_id)
            return
        size = self.output_sizes[loaded_shard_id] // self.tp_size
        offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        src = narrow_full(name, loaded_weight, dim, self.output_sizes[loaded_shard_id],
                          self.tp_rank * size, size)
        copy_checked(name, param.data.narrow(dim, offset, size), src)


class QKVParallelLinear(ColumnParallelLinear):
    """The attention's packed query, key and value projections, sharded by heads.

    Query heads are split across ranks; key/value heads too when there are at least as
    many as ranks, else each KV head is replicated on ``tp / total_num_kv_heads`` ranks.
    ``weight_loader(param, full, loaded_shard_id)`` takes ``"q"``, ``"k"`` or ``"v"``
    in full, or with ``None`` the three fused on disk (``[q; k; v]``).

    :param hidden_size: in features.
    :param head_size: size of each query/key head.
    :param total_num_heads: query heads (all ranks); divisible by the TP size.
    :param total_num_kv_heads: key/value heads (default: ``total_num_heads``); divisible
        by the TP size, or dividing it.
    :param v_head_size: size of each value head (default ``head_size``).
    :raises opmux.distributed.ParallelSizeError: heads and TP size do not divide.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = True,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: Any = None, prefix: str = "", *, return_bias: bool = True,
                 disable_tp: bool = False, v_head_size: int | None = None) -> None:
        for name, value in (("hidden_size", hidden_size), ("head_size", head_size),
                            ("total_num_heads", total_num_heads),
                            ("total_num_kv_heads", total_num_kv_heads),
                            ("v_head_size", v_head_size)):
            if value is not None or name in ("hidden_size", "head_size", "total_num_heads"):
                check_size("QKVParallelLinear", name, value)
        if total_num_kv_heads is not None and total_num_kv_heads > total_num_heads:
            raise OpInputError(
                f"QKVParallelLinear: total_num_kv_heads ({total_num_kv_heads}) must not exceed "
                f"total_num_heads ({total_num_heads})", argument="total_num_kv_heads")
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.v_head_size = v_head_size if v_head_size is not None else head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = (total_num_kv_heads if total_num_kv_heads is not None
                                   else total_num_heads)
        _, tp, _ = tp_coords(disable_tp)
        self.num_heads = divide(total_num_heads, tp, "QKVParallelLinear total_num_heads")
        if tp >= self.total_num_kv_heads:
            if tp % self.total_num_kv_heads:
                raise ParallelSizeError(
                    f"QKVParallelLinear total_num_kv_heads = {self.total_num_kv_heads} "
                    f"does not divide the tensor-parallel world size {tp} (KV heads are "
                    f"replicated evenly when there are fewer than ranks)",
                    what="QKVParallelLinear total_num_kv_heads",
                    numerator=tp, denominator=self.total_num_kv_heads)
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp // self.total_num_kv_heads
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp,
                                       "QKVParallelLinear total_num_kv_heads")
            self.num_kv_head_replicas = 1
        self.output_sizes = [self.num_heads * head_size * tp,
                             self.num_kv_heads * head_size * tp,
                             self.num_kv_heads * self.v_head_size * tp]
        super().__init__(hidden_size, sum(self.output_sizes), bias, False, skip_bias_add,
                         params_dtype, quant_config, prefix, return_bias=return_bias,
                         disable_tp=disable_tp)

    def _full_sizes(self) -> dict[str, int]:
        return {"q": self.total_num_heads * self.head_size,
                "k": self.total_num_kv_heads * self.head_size,
                "v": self.total_num_kv_heads * self.v_head_size}

    def weight_loader(self, param: Parameter, loaded_weight: Tensor,  # type: ignore[override]
                      loaded_shard_id: str | None = None) -> None:
        name = type(self).__name__
        if loaded_shard_id not in (None, "q", "k", "v"):
            raise OpInputError(
                f"{name}.weight_loader: argument 'loaded_shard_id': expected 'q', 'k', 'v' "
                f"or None, got {loaded_shard_id!r}", op=name, argument="loaded_shard_id")
        dim = getattr(param, "output_dim", None)
        if dim is None:
            copy_checked(name, param.data, loaded_weight)
            return
        full = self._full_sizes()
        if loaded_shard_id is None:
            total = sum(full.values())
            parts = narrow_full(name, loaded_weight, dim, total, 0, total)
            for shard_id, part in zip(full, parts.split(list(full.values()), dim),
                                      strict=True):
                self.weight_loader(param, part, shard_id)
            return
        q = self.num_heads * self.head_size
        k = self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q), "k": (q, k),
                        "v": (q + k, self.num_kv_heads * self.v_head_size)}[loaded_shard_id]
        shard_rank = (self.tp_rank if loaded_shard_id == "q"
                      else self.tp_rank // self.num_kv_head_replicas)
        src = narrow_full(name, loaded_weight, dim, full[loaded_shard_id], shard_rank * size,
                          size)
        copy_checked(name, param.data.narrow(dim, offset, size), src)


@CustomOp.register("row_parallel_linear")
class RowParallelLinear(LinearBase):
    """``Y = X A + b`` with ``A`` split along its input dimension (``X`` along its last).

    :param input_size: in features (all ranks together); divisible by the TP size.
    :param output_size: out features.
    :param bias: add a bias (not sharded; added once, on rank 0, before the reduction).
    :param input_is_parallel: the input is already this rank's slice; otherwise the
        layer slices the full input itself.
    :param skip_bias_add: return the bias instead of adding it.
    :param params_dtype: parameter dtype.
    :param reduce_results: all-reduce the partial outputs (every rank gets ``Y``);
        otherwise each rank returns its partial sum.
    :param return_bias: return ``(output, output_bias)`` (default) or ``output``.
    :param disable_tp: do not shard.
    :raises opmux.ConfigError: ``reduce_results=False`` with a bias that is added.
    :raises opmux.distributed.ParallelSizeError: the TP size does not divide ``input_size``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = True, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, reduce_results: bool = True,
                 quant_config: Any = None, prefix: str = "", *, return_bias: bool = True,
                 disable_tp: bool = False) -> None:
        super().__init__(input_size, output_size, bias, skip_bias_add, params_dtype,
                         quant_config, prefix, return_bias=return_bias, disable_tp=disable_tp)
        if not reduce_results and bias and not skip_bias_add:
            raise ConfigError(
                "RowParallelLinear: reduce_results=False with a bias that is added would "
                "leave the bias in one rank's partial sum only; reduce the results or pass "
                "skip_bias_add=True")
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size,
                                               "RowParallelLinear input_size")
        self.output_size_per_partition = output_size
        self.output_partition_sizes = [output_size]
        self.weight = self._new_param(output_size, self.input_size_per_partition,
                                      input_dim=1, output_dim=0)
        self.bias = self._new_param(output_size, output_dim=0) if bias else None

    def weight_loader(self, param: Parameter, loaded_weight: Tensor) -> None:
        """Keep this rank's columns of the full tensor (``input_dim``); copy others whole."""
        dim = getattr(param, "input_dim", None)
        load_rank_slice(type(self).__name__, param, loaded_weight, dim, self.tp_rank, self.tp_size)

    def forward_native(self, input_: Tensor) -> LinearOutput:
        if self.input_is_parallel or self.tp_size == 1:
            input_parallel = input_
        else:
            size = self.input_size_per_partition
            input_parallel = input_.narrow(-1, self.tp_rank * size, size).contiguous()
        bias = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        output = dense_linear(input_parallel, self.weight, bias)
        if self.reduce_results and self.tp_size > 1:
            all_reduce_(output, self.tp_group_name)  # our own fresh tensor: no copy
        return self._result(output)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size_per_partition}, "
                f"output_features={self.output_size}, bias={self.bias is not None}, "
                f"tp_size={self.tp_size}, reduce_results={self.reduce_results}")
