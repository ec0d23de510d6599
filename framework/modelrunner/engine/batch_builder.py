"""Turn a scheduler decision into one flattened :class:`ForwardBatch` on CPU tensors.

This runs every step, so per-sequence Python work is limited to slicing lists; positions, slot
mapping and the sampled rows are computed with a handful of tensor operations.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from ..forward_batch import ForwardBatch
from ..kv_cache.allocator import BlockAllocator
from .scheduler import ScheduledSequence


def build_forward_batch(
    scheduled: Seq[ScheduledSequence],
    allocator: BlockAllocator,
    finished_seq_ids: tuple[int, ...] = (),
) -> tuple[ForwardBatch, list[int]]:
    """Flatten the scheduled sequences into one batch.

    Logits are requested only at the last scheduled token of sequences whose step reaches their
    final token (a completed prompt or a decode); intermediate prefill chunks sample nothing.
    Request extras (e.g. ``images``) are passed as ``batch.extra[key] = {seq_id: value}``.

    :returns: the batch, and for each logits row the index into ``scheduled`` it belongs to.
    """
    if not scheduled:
        raise ValueError("cannot build a forward batch from zero scheduled sequences")
    input_ids: list[int] = []
    seq_ids: list[int] = []
    starts: list[int] = []
    query_lens: list[int] = []
    tables: list[list[int]] = []
    sampled_rows: list[int] = []
    extra: dict[str, dict[int, Any]] = {}
    for i, item in enumerate(scheduled):
        seq = item.seq
        start, n = item.start, item.num_new_tokens
        input_ids += seq.token_ids[start:start + n]
        seq_ids.append(seq.seq_id)
        starts.append(start)
        query_lens.append(n)
        tables.append(allocator.block_table(seq.seq_id))
        if start + n == len(seq.token_ids):
            sampled_rows.append(i)
        if seq.request.extra:
            for key, value in seq.request.extra.items():
                extra.setdefault(key, {})[seq.seq_id] = value

    block_size = allocator.block_size
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
    q_lens = torch.tensor(query_lens, dtype=torch.long)
    context_lens = torch.tensor(starts, dtype=torch.long)
    query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.long)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    num_tokens = len(input_ids)
    max_query_len = max(query_lens)
    if max_query_len == 1:
        positions = context_lens.clone()
        seq_index = torch.arange(len(scheduled))
    else:
        seq_index = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens, output_size=num_tokens)
        positions = torch.arange(num_tokens) + (context_lens - query_start_loc[:-1])[seq_index]
    slot_mapping = block_tables[seq_index, positions // block_size] * block_size + positions % block_size
    seq_lens = context_lens + q_lens
    logits_indices = query_start_loc[1:][torch.tensor(sampled_rows, dtype=torch.long)]
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=positions,
        seq_ids=tuple(seq_ids),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        context_lens=context_lens,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        logits_indices=logits_indices - 1,
        block_size=block_size,
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
        finished_seq_ids=tuple(finished_seq_ids),
        extra=extra,
    )
    return batch, sampled_rows
