"""Shape normalisation so a handful of compiled graphs serve every step.

Decode steps are padded up to a bucket of rows. A padding row repeats the step's last row exactly
(token, position, slot, block table, lengths), so it computes the very same keys and values and
writes them to the very same cache slot: the cache never sees anything a real row would not have
written, and no slot has to be reserved for padding. Its outputs are dropped.

Every step also gets a key length of at least two blocks, and a block table of exactly the blocks
that length needs plus one column of block 0 (never attended: attention masks keys by position).
The number of gathered blocks then never takes the value 1 (which torch specializes) and always
stands in the same relation to the table's width, so the graphs' guards keep holding while
sequences grow and the width is a dynamic dimension. A lone fresh prompt keeps its
``max_seq_len == max_query_len`` (attention's plain-causal fast path) by raising both.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from modelrunner.api import ForwardBatch

_PER_TOKEN = ("input_ids", "positions", "slot_mapping")
_PER_SEQUENCE = ("seq_lens", "context_lens", "block_tables")


def bucket_for(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``rows``, or ``rows`` itself past the largest bucket."""
    i = bisect.bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else rows


MIN_KEY_BLOCKS = 2
"""Fewest KV-cache blocks a compiled step gathers per sequence."""


def normalize_key_length(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` with ``max_seq_len`` of at least :data:`MIN_KEY_BLOCKS` blocks and exactly
    ``ceil(max_seq_len / block_size) + 1`` block-table columns, the last all zeros.

    :raises ValueError: the block tables do not cover ``max_seq_len``.
    """
    tables, block_size = batch.block_tables, batch.block_size
    needed = -(-batch.max_seq_len // block_size)
    if tables.shape[1] < needed:
        raise ValueError(f"block tables have {tables.shape[1]} columns but max_seq_len={batch.max_seq_len} needs "
                         f"{needed} blocks of {block_size}")
    changes: dict[str, Any] = {}
    if needed < MIN_KEY_BLOCKS:
        longer = (MIN_KEY_BLOCKS - 1) * block_size + 1
        if batch.num_seqs == 1 and batch.max_seq_len == batch.max_query_len and not batch.is_decode_only:
            changes["max_query_len"] = longer  # a lone fresh prompt stays one (only attention's padding grows)
        changes["max_seq_len"] = longer
        needed = MIN_KEY_BLOCKS
    width = min(needed, tables.shape[1])
    padding = tables.new_zeros(tables.shape[0], needed + 1 - width)
    changes["block_tables"] = torch.cat([tables[:, :width], padding], dim=1)
    return attrs.evolve(batch, **changes)


def repeat_last_row(tensor: torch.Tensor, extra: int) -> torch.Tensor:
    """``tensor`` with its last row (along dim 0) appended ``extra`` more times."""
    return torch.cat([tensor, tensor[-1:].expand(extra, *tensor.shape[1:])])


def pad_decode_batch(batch: ForwardBatch, rows: int) -> ForwardBatch:
    """A decode-only ``batch`` (one token per sequence) padded to ``rows`` sequences by repeating its last one.

    ``logits_indices`` keeps pointing at the real rows, which stay first.
    """
    if not batch.is_decode_only:
        raise ValueError(f"only decode steps (one new token per sequence) are padded; "
                         f"max_query_len={batch.max_query_len}")
    extra = rows - batch.num_seqs
    if extra < 0:
        raise ValueError(f"cannot pad a step of {batch.num_seqs} sequences down to {rows} rows")
    if extra == 0:
        return batch
    padded: dict[str, Any] = {name: repeat_last_row(getattr(batch, name), extra) for name in _PER_TOKEN + _PER_SEQUENCE}
    padded["query_start_loc"] = torch.arange(rows + 1, dtype=batch.query_start_loc.dtype,
                                             device=batch.query_start_loc.device)
    padded["seq_ids"] = batch.seq_ids + batch.seq_ids[-1:] * extra
    return attrs.evolve(batch, **padded)


def pad_rows(value: Any, rows: int, extra: int) -> Any:
    """Pad every tensor in ``value`` (a tensor, or a tuple/list/dict of them) whose first dim is ``rows``
    by repeating its last row ``extra`` times (e.g. ``inputs_embeds`` alongside the token ids)."""
    if isinstance(value, torch.Tensor):
        return repeat_last_row(value, extra) if value.dim() and value.shape[0] == rows else value
    if type(value) in (tuple, list):
        return type(value)(pad_rows(v, rows, extra) for v in value)
    if type(value) is dict:
        return {k: pad_rows(v, rows, extra) for k, v in value.items()}
    return value


def drop_padding(value: Any, rows: int, padded_rows: int) -> Any:
    """Cut every tensor in ``value`` whose first dim is ``padded_rows`` back to its first ``rows``."""
    if isinstance(value, torch.Tensor):
        return value[:rows] if value.dim() and value.shape[0] == padded_rows else value
    if type(value) in (tuple, list):
        return type(value)(drop_padding(v, rows, padded_rows) for v in value)
    if type(value) is dict:
        return {k: drop_padding(v, rows, padded_rows) for k, v in value.items()}
    return value
