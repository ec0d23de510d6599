"""Linear layers that can be split across a tensor-parallel group, each with per-parameter weight loaders.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``: it receives the *full*
checkpoint tensor, checks its shape, and copies this rank's slice into the parameter. Packed layers
(:class:`QKVParallelLinear`, :class:`MergedColumnParallelLinear`) are loaded once per checkpoint
projection, with ``shard_id`` saying which one (``"q"``/``"k"``/``"v"`` or an index).

Column-parallel layers split the output features (no communication: each rank keeps its slice of
the activations); row-parallel layers split the input features and all-reduce the partial sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from .dense import dense


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def copy_checked(dst: torch.Tensor, src: torch.Tensor, expected_shape: Sequence[int] | None = None) -> None:
    """Copy ``src`` into ``dst`` after checking the checkpoint tensor has the shape the layer needs.

    :param expected_shape: the full (unsplit) shape ``src`` must have; defaults to ``dst``'s shape.
    :raises ValueError: naming the expected and the actual shape.
    """
    expected = tuple(dst.shape if expected_shape is None else expected_shape)
    if tuple(src.shape) != expected:
        raise ValueError(f"expected shape {list(expected)}, got {list(src.shape)}")
    dst.copy_(src)


@attrs.frozen
class Placement:
    """Where this rank's part of a full checkpoint tensor goes in a parameter.

    Layers describe their sharding this way once, so the same rule loads float weights and, through a
    quantization method's ``quant_loader``, quantized blocks (which narrow along rows and whole blocks).
    """

    full_shape: tuple[int, ...]
    """The shape the whole checkpoint tensor must have."""
    src: tuple[int, int, int] | None = None
    """``(dim, start, length)`` of the checkpoint tensor this rank takes; None: all of it."""
    dst: tuple[int, int] | None = None
    """``(start, length)`` rows of the parameter it fills; None: all of it."""


def place(param: torch.Tensor, loaded_weight: Any, placement: Placement) -> None:
    """Copy ``placement``'s part of ``loaded_weight`` into ``param`` (or hand the whole tensor, with
    the part to take, to the parameter's ``quant_loader(param, tensor, dst, src)``, which a
    quantization method installs on quantized storage).

    :raises ValueError: the checkpoint tensor does not have ``placement.full_shape``.
    """
    if tuple(loaded_weight.shape) != tuple(placement.full_shape):
        raise ValueError(f"expected shape {list(placement.full_shape)}, got {list(loaded_weight.shape)}")
    quant_loader = getattr(param, "quant_loader", None)
    if quant_loader is not None:
        # The whole tensor goes: quantization groups are formed over it, then narrowed (so a split
        # layer quantizes exactly as the unsplit one).
        quant_loader(param, loaded_weight, placement.dst, placement.src)
        return
    src = loaded_weight if placement.src is None else loaded_weight.narrow(*placement.src)
    dst = param.data if placement.dst is None else param.data.narrow(0, *placement.dst)
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    """Load a replicated parameter: the checkpoint tensor must match it exactly."""
    if shard_id is not None:
        raise ValueError(f"parameter is not packed; got shard {shard_id!r}")
    place(param, loaded_weight, Placement(logical_shape(param)))


def logical_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape a parameter stands for: its own, or the float shape a quantized storage replaces
    (``param.logical_shape``, set by the quantization method)."""
    return tuple(getattr(param, "logical_shape", param.shape))


def _new_param(shape: Sequence[int], loader: Any) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


class LinearBase(nn.Module):
    """Common state of the linear layers: sizes, this rank's place in the tensor-parallel group."""

    DENSE_WEIGHTS = ("weight",)
    """Parameters :func:`~modelrunner.layers.dense.prepack_weights` packs (forward passes them to ``dense``)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        self.input_size = input_size
        """Input features of the full (unsplit) layer."""
        self.output_size = output_size
        """Output features of the full (unsplit) layer."""
        self.tp_rank = tp_rank
        """This process's rank in the tensor-parallel group."""
        self.tp_size = tp_size
        """Size of the tensor-parallel group."""
        self.tp_group = tp_group
        """The torch.distributed group collectives run on (None: the default group)."""
        self.quant_scheme: Any = None
        """How a quantization method stores and multiplies this layer's weight (None: dense floats)."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x Wᵀ + bias`` with this rank's weight: the quantization scheme's kernel, else :func:`dense`."""
        if self.quant_scheme is not None:
            return self.quant_scheme.apply(self, x, bias)
        return dense(x, self.weight, bias)

    def extra_repr(self) -> str:
        quant = f", quant={self.quant_scheme}" if self.quant_scheme is not None else ""
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_rank}/{self.tp_size}{quant}"


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, **tp: Any) -> None:
        super().__init__(input_size, output_size, bias, **tp)
        self.weight = _new_param((output_size, input_size), default_weight_loader)
        self.bias = _new_param((output_size,), default_weight_loader) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ + b``."""
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """``Y = X Aᵀ`` with ``A``'s output rows split across ranks; each rank returns its slice of ``Y``.

    :param gather_output: all-gather the slices so every rank returns the full ``Y``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False,
                 **tp: Any) -> None:
        super().__init__(input_size, output_size, bias, **tp)
        self.output_size_per_partition = _divide(output_size, self.tp_size, f"{type(self).__name__} output size")
        """Output features held by this rank."""
        self.gather_output = gather_output
        """Whether forward all-gathers the output slices."""
        self.weight = _new_param((self.output_size_per_partition, input_size), self.weight_loader)
        self.bias = _new_param((self.output_size_per_partition,), self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's rows of the full checkpoint weight (or bias)."""
        place(param, loaded_weight, self.placement(param, shard_id))

    def placement(self, param: nn.Parameter, shard_id: Any = None) -> Placement:
        """This rank's rows of the full checkpoint weight (or bias)."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not packed; got shard {shard_id!r}")
        size = self.output_size_per_partition
        return Placement((self.output_size, *logical_shape(param)[1:]), src=(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features (all of them with ``gather_output``)."""
        y = self.matmul(x, self.bias)
        if self.gather_output and self.tp_size > 1:
            y = all_gather_last_dim(y, self.tp_size, self.tp_group)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. ``gate_up_proj``).

    Checkpoint projection ``i`` (``shard_id=i``) fills rows ``sum(output_sizes[:i]) / tp_size`` onward.

    :param output_sizes: the full output features of each packed projection, in order.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, **kw: Any) -> None:
        self.output_sizes = list(output_sizes)
        """Full output features of each packed projection."""
        super().__init__(input_size, sum(self.output_sizes), bias, **kw)
        for i, size in enumerate(self.output_sizes):
            _divide(size, self.tp_size, f"{type(self).__name__} output {i}")

    def placement(self, param: nn.Parameter, shard_id: Any = None) -> Placement:
        """This rank's rows of packed projection ``shard_id``, at their place in the fused parameter."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index below {len(self.output_sizes)}, got {shard_id!r}")
        full = self.output_sizes[shard_id]
        size = full // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        return Placement((full, *logical_shape(param)[1:]), src=(0, self.tp_rank * size, size), dst=(offset, size))


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections fused into one column-parallel matmul (``qkv_proj``).

    Heads are split across ranks; when there are fewer key/value heads than ranks, each key/value head
    is replicated on ``tp_size // total_num_kv_heads`` ranks. The output of each rank is laid out
    ``[q heads | k heads | v heads]``.
    """

    SHARDS = ("q", "k", "v")
    """Names of the packed projections; ``shard_id`` may also be their index."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = False, **tp: Any) -> None:
        tp_size = tp.get("tp_size", 1)
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_dim = head_dim
        """Size of one attention head."""
        self.total_num_heads = total_num_heads
        """Query heads of the full layer."""
        self.total_num_kv_heads = total_num_kv_heads
        """Key/value heads of the full layer."""
        self.num_heads = _divide(total_num_heads, tp_size, "number of attention heads")
        """Query heads on this rank."""
        if tp_size >= total_num_kv_heads:
            _divide(tp_size, total_num_kv_heads, "tensor-parallel size (as a multiple of the kv heads)")
            self.num_kv_heads = 1
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "number of key/value heads")
        """Key/value heads on this rank."""
        self.q_size = self.num_heads * head_dim
        """Query features on this rank."""
        self.kv_size = self.num_kv_heads * head_dim
        """Key (and value) features on this rank."""
        output_size = (total_num_heads + 2 * max(total_num_kv_heads, tp_size)) * head_dim
        super().__init__(hidden_size, output_size, bias, **tp)

    def placement(self, param: nn.Parameter, shard_id: Any = None) -> Placement:
        """This rank's heads of the ``q``, ``k`` or ``v`` checkpoint projection, at their place in the fused parameter."""
        if isinstance(shard_id, int) and 0 <= shard_id < 3:
            shard_id = self.SHARDS[shard_id]
        if shard_id == "q":
            offset, size, full_heads, rank = 0, self.q_size, self.total_num_heads, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, full_heads = self.kv_size, self.total_num_kv_heads
            replicas = max(1, self.tp_size // self.total_num_kv_heads)
            rank = self.tp_rank // replicas
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        full = (full_heads * self.head_dim, *logical_shape(param)[1:])
        return Placement(full, src=(0, rank * size, size), dst=(offset, size))


class RowParallelLinear(LinearBase):
    """``Y = X Aᵀ`` with ``A``'s input columns split across ranks; the partial products are all-reduced.

    The input is expected already split (the output of a column-parallel layer). The bias is added
    once, after the reduction.

    :param reduce_results: all-reduce across the group (turn off to fuse the reduction elsewhere).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True,
                 **tp: Any) -> None:
        super().__init__(input_size, output_size, bias, **tp)
        self.input_size_per_partition = _divide(input_size, self.tp_size, f"{type(self).__name__} input size")
        """Input features held by this rank."""
        self.reduce_results = reduce_results
        """Whether forward all-reduces the partial products."""
        self.weight = _new_param((output_size, self.input_size_per_partition), self.weight_loader)
        self.bias = _new_param((output_size,), default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's columns of the full checkpoint weight."""
        place(param, loaded_weight, self.placement(param, shard_id))

    def placement(self, param: nn.Parameter, shard_id: Any = None) -> Placement:
        """This rank's columns of the full checkpoint weight."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not packed; got shard {shard_id!r}")
        size = self.input_size_per_partition
        return Placement((self.output_size, self.input_size), src=(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full output from this rank's input slice (partial products summed across ranks)."""
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        y = self.matmul(x, None)
        if self.reduce_results:
            import torch.distributed as dist

            dist.all_reduce(y, group=self.tp_group)
        return y if self.bias is None else y + self.bias


def all_gather_last_dim(x: torch.Tensor, tp_size: int, group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (rank order)."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
