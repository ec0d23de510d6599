"""Adapter slots on the kernel's linear layers, and where each PEFT projection lands in them.

A :class:`LoRALayer` holds, for one linear layer, ``max_loras`` slots of stacked A/B matrices on the
model's device and dtype. A fused layer's packed projections share one stack: projection ``i`` uses
ranks ``i·max_rank …`` of A and writes only its own output rows of B, so a LoRA on ``q_proj`` lands on
the q rows of ``qkv_proj`` and one shrink/expand pair serves the three. Tensor parallelism splits the
matrices as the layer splits: B's rows follow a column-parallel layer's output rows (the layer's own
``placement``), A's columns a row-parallel layer's input columns (its partial deltas are all-reduced).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
import torch
from torch import nn

from modelrunner.api import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                             RowParallelLinear)

from .checkpoint import TARGETS, LoRAError, LoRAWeights

ShardWeights = tuple[torch.Tensor, torch.Tensor]
"""This rank's ``(A [rank, in_local], B [out_rows, rank] · scaling)`` of one packed projection."""


def packed_mapping(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Checkpoint projection → ``(fused layer, index)`` from every ``packed_modules_mapping`` in ``model``."""
    out: dict[str, tuple[str, int]] = {}
    for module in model.modules():
        mapping = getattr(module, "packed_modules_mapping", None)
        if not isinstance(mapping, dict):  # e.g. FusedMoE's method of the same name (experts carry no LoRA)
            continue
        for fused, parts in mapping.items():
            for i, part in enumerate(parts):
                out[part] = (fused, i)
    return out


class LoRALayer:
    """``max_loras`` adapter slots of one linear layer.

    :param module: the layer (a ``modelrunner.api.LinearBase``).
    :param name: its name in the model.
    """

    def __init__(self, module: LinearBase, name: str, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.module = module
        """The linear layer the deltas are added to."""
        self.name = name
        """The layer's name in the model."""
        self.num_shards = len(getattr(module, "output_sizes", None) or ()) or \
            (3 if isinstance(module, QKVParallelLinear) else 1)
        """Packed projections (3 for q/k/v, 2 for gate/up, else 1)."""
        self.max_rank = max_rank
        """Ranks each packed projection gets in a slot."""
        in_local = getattr(module, "input_size_per_partition", module.input_size)
        out_local = getattr(module, "output_size_per_partition", module.output_size)
        rank = self.num_shards * max_rank
        self.lora_a = torch.zeros(max_loras, rank, in_local, device=device, dtype=dtype)
        """``[slots, num_shards · max_rank, in_local]``."""
        self.lora_b = torch.zeros(max_loras, rank, out_local, device=device, dtype=dtype).transpose(1, 2)
        """``[slots, out_local, num_shards · max_rank]`` with each adapter's scaling folded in; stored
        rank-major underneath, so that ``lora_b.transpose(1, 2).reshape(slots * rank, out_local)`` (every
        slot's B stacked, what a kernel expands a mixed step through in one matmul) is a view."""
        self.reduces = isinstance(module, RowParallelLinear) and module.tp_size > 1 and module.reduce_results
        """Whether the delta is a partial sum to all-reduce (row-parallel over several ranks)."""

    def shard_weights(self, shard: int, weights: LoRAWeights, scaling: float, where: Path) -> ShardWeights:
        """This rank's part of one projection's A and B (B scaled), shapes checked against the layer.

        :raises LoRAError: A's input features or B's output features differ from the layer's.
        """
        module = self.module
        a, b = weights.lora_a, weights.lora_b
        if a.shape[1] != module.input_size:
            raise LoRAError(f"{where}: {self.name} (projection {shard}) lora_A takes {a.shape[1]} input features but "
                            f"the model's layer takes {module.input_size}: an adapter for another model "
                            "(architecture or hidden size)?")
        if isinstance(module, RowParallelLinear):
            size = module.input_size_per_partition
            a = a.narrow(1, module.tp_rank * size, size)
            full_out, rows = module.output_size, None
        elif isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
            placement = module.placement(torch.empty(1, b.shape[1], device="meta"), shard)
            full_out, rows = placement.full_shape[0], placement
        elif isinstance(module, ColumnParallelLinear):
            placement = module.placement(torch.empty(1, b.shape[1], device="meta"))
            full_out, rows = placement.full_shape[0], placement
        else:
            full_out, rows = module.output_size, None
        if b.shape[0] != full_out:
            raise LoRAError(f"{where}: {self.name} (projection {shard}) lora_B gives {b.shape[0]} output features "
                            f"but the model's layer has {full_out}: an adapter for another model?")
        if rows is not None and rows.src is not None:
            b = b.narrow(*rows.src)
        return a.contiguous(), (b * scaling).contiguous()

    def dst_rows(self, shard: int, rows: int) -> tuple[int, int]:
        """``(start, length)`` of this rank's output rows that projection ``shard`` writes."""
        module = self.module
        if isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
            dst = module.placement(torch.empty(1, 1, device="meta"), shard).dst
            if dst is not None:
                return dst
        return 0, rows

    def load(self, slot: int, shards: dict[int, ShardWeights]) -> None:
        """Fill ``slot`` with an adapter's projections (zeros where it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for shard, (a, b) in shards.items():
            r0 = shard * self.max_rank
            rank = a.shape[0]
            start, length = self.dst_rows(shard, b.shape[0])
            self.lora_a[slot, r0:r0 + rank].copy_(a)
            self.lora_b[slot, start:start + length, r0:r0 + rank].copy_(b)


def lora_layers(model: nn.Module) -> dict[str, LinearBase]:
    """The model's linear layers that may carry LoRA, by name (those whose own name is a projection
    a LoRA targets, fused or not)."""

    fused = {f for f, _ in packed_mapping(model).values()}
    wanted = set(TARGETS) | fused
    return {name: m for name, m in model.named_modules()
            if isinstance(m, LinearBase) and name.rsplit(".", 1)[-1] in wanted}


def resolve_target(peft_module: str, layers: Iterable[str], packed: dict[str, tuple[str, int]]) -> tuple[str, int]:
    """The model layer and packed index a PEFT module name (``model.layers.0.self_attn.q_proj``) lands on.

    The name is matched exactly, else by its longest suffix that names exactly one layer (a model
    nested differently from the checkpoint's, e.g. a vision-language model's language model).

    :raises KeyError: no layer matches.
    """
    prefix, _, leaf = peft_module.rpartition(".")
    fused, index = packed.get(leaf, (leaf, 0))
    target = f"{prefix}.{fused}" if prefix else fused
    names = list(layers)
    if target in names:
        return target, index
    parts = target.split(".")
    for i in range(1, len(parts) - 1):
        suffix = ".".join(parts[i:])
        matches = [n for n in names if n.endswith("." + suffix) or n == suffix]
        if len(matches) == 1:
            return matches[0], index
    raise KeyError(target)


def resolve_all(modules: dict[str, LoRAWeights], layers: dict[str, LoRALayer], packed: dict[str, tuple[str, int]],
                where: Path) -> dict[str, dict[int, LoRAWeights]]:
    """Layer name → packed index → weights, for every module of an adapter.

    :raises LoRAError: a module the model does not have.
    """
    out: dict[str, dict[int, LoRAWeights]] = {}
    for peft_module, weights in modules.items():
        try:
            name, index = resolve_target(peft_module, layers, packed)
        except KeyError:
            raise LoRAError(f"{where}: target module {peft_module!r} is not in the model (an adapter for another "
                            f"architecture?); the model's LoRA-capable layers are like "
                            f"{next(iter(layers), '(none)')!r}") from None
        out.setdefault(name, {})[index] = weights
    return out

