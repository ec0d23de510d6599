"""The default ``lora_kernels`` plugin: ``torch``, the batched LoRA apply in plain torch ops."""

from __future__ import annotations

import torch

from modelrunner.api import LoRAKernel, LoRAMapping

GROUPED_FROM = 128
"""Rows × (adapters in the step - 1) from which a mixed step runs each adapter's rows apart. Timed on
SmolLM2's shapes over 4 rank-16 adapters (2 Zen 3 cores): up to 16 rows the masked form wins on every
layer (gate/up at 16 rows: 199 µs against 279); at 64 rows grouping wins on the wide layers
(gate/up 379 µs against 462, q/k/v 263 against 303) and loses on the narrow one (down 224 against
146), and the whole batch-64 benchmark runs 0.77× the base model grouped against 0.75× masked."""


class TorchLoRAKernel(LoRAKernel):
    """The default. A step of one adapter runs two plain matmuls over all rows. A mixed step of few
    rows runs in three ops whatever the number of adapters: it shrinks every token through every
    slot's A at once, keeps each token's own slot's ranks (a 0/1 mask computed once per step), and
    expands through every slot's B stacked (``[slots · rank, out]``, a view of the layers'
    rank-major storage), accumulating into the output in place; that multiplies by zeros for the
    other slots, so a mixed step of many rows (:data:`GROUPED_FROM`) instead gathers each adapter's
    rows, applies its A and B, and adds them back (four ops per adapter)."""

    name = "torch"

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              mapping: LoRAMapping) -> torch.Tensor:
        groups = mapping.groups
        if len(groups) == 1 and groups[0][1] is None:
            slot = groups[0][0]
            shrunk, expand = x @ lora_a[slot].t(), lora_b[slot].t()
        elif x.shape[0] * (len(groups) - 1) >= GROUPED_FROM:
            for slot, rows in groups:
                y.index_add_(0, rows, (x.index_select(0, rows) @ lora_a[slot].t()) @ lora_b[slot].t())
            return y
        else:
            slots, rank, _ = lora_a.shape
            shrunk = (x @ lora_a.reshape(slots * rank, -1).t()).mul_(mapping.rank_mask(slots, rank, x.dtype))
            expand = lora_b.transpose(1, 2).reshape(slots * rank, -1)
        if y.dtype == shrunk.dtype and y.is_contiguous():
            return y.addmm_(shrunk, expand)
        return y.add_(shrunk @ expand)
