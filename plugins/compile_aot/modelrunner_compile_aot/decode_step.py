"""The decode step as a module of plain tensors, which is what ``torch.export`` takes.

The runner hands the model a :class:`~modelrunner.forward_batch.ForwardBatch`, an object with
Python integers the attention metadata branches on. For a decode step those are fixed or follow
from tensor shapes: every sequence has one new token (``max_query_len = 1``), its context is its
position, and the longest sequence fits in the block table's columns. :class:`DecodeStep` rebuilds
the batch from its tensors inside ``forward``, so the export sees a graph with symbolic sequence and
block counts and no Python control flow that depends on data.

Steps have at least :data:`MIN_ROWS` rows and :data:`MIN_BLOCK_COLUMNS` block-table columns, so
no dimension is specialized to 1; smaller steps are padded by repeating their last row (which
recomputes and rewrites the very same cache entry).
"""

from __future__ import annotations

import torch
from torch import nn

from modelrunner.api import ForwardBatch

MIN_ROWS = 2
"""Fewest sequences the exported step takes (a batch of one is padded to two)."""
MIN_BLOCK_COLUMNS = 2
"""Fewest block-table columns the exported step takes (extra columns are block 0, never attended)."""
MAX_ROWS = 4096
"""Most sequences the exported step takes."""


class DecodeStep(nn.Module):
    """``model``'s forward over a decode step given as tensors.

    :param model: the adapter's module (``model(batch, kv_caches)``).
    :param block_size: tokens per KV-cache block.
    """

    def __init__(self, model: nn.Module, block_size: int) -> None:
        super().__init__()
        self.model = model
        self.block_size = block_size
        """Tokens per KV-cache block."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Final hidden states ``[rows, hidden]``; the new keys/values land in ``kv_caches`` at ``slot_mapping``."""
        rows = input_ids.shape[0]
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            seq_ids=(),
            query_start_loc=torch.arange(rows + 1, device=input_ids.device),
            seq_lens=seq_lens,
            context_lens=positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            logits_indices=torch.arange(rows, device=input_ids.device),
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=block_tables.shape[1] * self.block_size,
        )
        return self.model(batch, kv_caches)


def decode_inputs(batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
    """The tensors :class:`DecodeStep` takes for a decode-only ``batch``, padded to the exported minimums."""
    tensors = [batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens]
    missing_rows = MIN_ROWS - batch.num_seqs
    if missing_rows > 0:
        tensors = [torch.cat([t, t[-1:].expand(missing_rows, *t.shape[1:])]) for t in tensors]
    tables = tensors[3]
    missing_cols = MIN_BLOCK_COLUMNS - tables.shape[1]
    if missing_cols > 0:
        tensors[3] = torch.cat([tables, tables.new_zeros(tables.shape[0], missing_cols)], dim=1)
    return tuple(tensors)


def dynamic_shapes(num_layers: int) -> tuple:
    """``torch.export`` dynamic shapes of :class:`DecodeStep`'s inputs: rows, block columns and the
    caches' block count vary; everything else is fixed by the model."""
    from torch.export import Dim

    rows = Dim("rows", min=MIN_ROWS, max=MAX_ROWS)
    columns = Dim("block_columns", min=MIN_BLOCK_COLUMNS)
    blocks = Dim("cache_blocks", min=2)
    per_row = {0: rows}
    return (per_row, per_row, per_row, {0: rows, 1: columns}, per_row, [{1: blocks} for _ in range(num_layers)])
