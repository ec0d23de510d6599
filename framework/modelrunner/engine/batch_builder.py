"""Turn a scheduler decision into one flattened :class:`ForwardBatch` on CPU tensors.

This runs every step, so per-sequence Python work is limited to slicing lists
(:meth:`ForwardBatch.build` does the rest with a handful of tensor operations).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import attrs

from ..forward_batch import ForwardBatch
from ..kv_cache.allocator import BlockAllocator
from .scheduler import ScheduledSequence


@attrs.frozen
class LogitsRowOwner:
    """Who a logits row of a step belongs to."""

    item: int
    """Index of the scheduled sequence in the step."""
    position: int
    """Position (in its sequence) of the token whose logits these are; they predict ``position + 1``."""
    samples: bool
    """True for the row the next token is sampled from (the sequence's last token)."""


def wants_prompt_logprobs(item: ScheduledSequence) -> bool:
    """Whether this step computes prompt tokens whose log-probabilities the request asked for."""
    seq = item.seq
    return (seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0 and seq.index == 0
            and item.start < seq.prompt_len - 1)


def build_forward_batch(
    scheduled: Seq[ScheduledSequence],
    allocator: BlockAllocator,
    finished_seq_ids: tuple[int, ...] = (),
) -> tuple[ForwardBatch, list[LogitsRowOwner]]:
    """Flatten the scheduled sequences into one batch.

    Logits are requested at the last scheduled token of sequences whose step reaches their final
    token (a completed prompt or a decode: the row sampled from), and at every prompt token of a
    request that asked for ``prompt_logprobs``; intermediate prefill chunks otherwise ask for none.
    Request extras (e.g. ``images``) are passed as ``batch.extra[key] = {seq_id: value}``.

    :returns: the batch, and who each of its logits rows belongs to.
    """
    if not scheduled:
        raise ValueError("cannot build a forward batch from zero scheduled sequences")
    owners: list[LogitsRowOwner] = []
    logits_rows: list[list[int]] = []
    extra: dict[str, dict[int, Any]] = {}
    for i, item in enumerate(scheduled):
        seq = item.seq
        end = item.start + item.num_new_tokens
        rows = []
        if wants_prompt_logprobs(item):
            for position in range(item.start, min(end, seq.prompt_len - 1)):
                rows.append(position - item.start)
                owners.append(LogitsRowOwner(i, position, False))
        if end == len(seq.token_ids) and seq.request.pooling is None:  # pooling requests sample nothing
            for j in range(len(item.draft) + 1):  # the last token, then each speculative draft token
                rows.append(item.num_new_tokens - 1 + j)
                owners.append(LogitsRowOwner(i, end - 1 + j, True))
        logits_rows.append(rows)
        if seq.request.extra:
            for key, value in seq.request.extra.items():
                extra.setdefault(key, {})[seq.seq_id] = value
    loras = {item.seq.request.lora_int_id: item.seq.request.lora_request for item in scheduled
             if item.seq.request.lora_request is not None}
    batch = ForwardBatch.build(
        [item.seq.seq_id for item in scheduled],
        [item.seq.token_ids[item.start:item.start + item.num_new_tokens] + item.draft for item in scheduled],
        [item.start for item in scheduled],
        [allocator.block_table(item.seq.seq_id) for item in scheduled],
        allocator.block_size, logits_rows, finished_seq_ids, extra,
    )
    if loras:
        batch = attrs.evolve(batch, lora_ids=tuple(item.seq.request.lora_int_id for item in scheduled), loras=loras)
    return batch, owners
