"""The portable paged-attention backend: block-table gather plus one ``scaled_dot_product_attention`` call.

Per layer and step, with no Python loop over sequences:

1. the new keys/values are written to their flat cache slots (``index_copy_`` at ``slot_mapping``);
2. every sequence's blocks are gathered (one ``index_select`` over its block table) into a padded
   ``[num_seqs, kv_len, kv_heads, head_dim]`` view, ``kv_len`` = the longest sequence rounded up to
   whole blocks;
3. queries are scattered into ``[num_seqs, max_query_len, heads, head_dim]`` and one SDPA call runs
   with a boolean mask built once per step from the token positions: key ``j`` is visible to a query
   at position ``p`` iff ``j <= p`` (and ``j > p - sliding_window``), which also hides the padding.

A step that mixes decodes with longer queries (a prompt chunk arriving while others generate)
runs its decodes and its other sequences as two separate parts, so the decodes' single queries
are not padded to the prompt chunk's length (:class:`SDPASplitMetadata`). A backend whose
``decode_rows_up_to`` is above 1 runs short queries (speculative verifications) as decode rows.

Decode-only steps skip the query scatter and fold each group of query heads that share a key/value
head into the query-length axis (``[S, kv_heads, heads // kv_heads, head_dim]``), so grouped-query
attention needs no repeated keys/values. Compiled, they attend through two plain reductions
instead of SDPA, which the compiler fuses with the block gather (:func:`_decode_attention_reductions`).
A lone prompt with nothing cached attends to its own keys/values directly with ``is_causal``.

Under ``torch.compile`` / ``torch.export`` the cache write goes through the custom op
``modelrunner::store_kv``, which declares that it mutates the cache: traced as plain ``index_copy_``
on a view of a graph input, the write is functionalized into a copy of the whole cache per layer
and step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from .attention_backend import AttentionBackend, AttentionLayer

if TYPE_CHECKING:
    from ..forward_batch import ForwardBatch


def _store_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


@torch.library.custom_op("modelrunner::store_kv", mutates_args=("kv_cache",))
def store_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``key``/``value`` (``[tokens, kv_heads, head_dim]``) into ``kv_cache`` at the flat slots
    ``slot_mapping``, in place, also inside compiled graphs."""
    _store_kv(kv_cache, slot_mapping, key, value)


def _decode_attention_reductions(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """Decode attention as plain reductions, for compilers: ``query`` ``[S, kv_heads, group, head_dim]``
    against ``keys``/``values`` ``[S, kv_heads, kv_len, head_dim]`` (views of the block gather), ``mask``
    ``[S, 1, 1, kv_len]``.

    Inductor fuses the block gather into the two reductions' loops, so the keys and values are read
    from the paged cache once, in place. Lowered as SDPA instead, they are first gathered into a
    copy and then read by a kernel whose per-head overhead dominates one-query problems
    (``bench/compile.py`` measures the difference).
    """
    scores = (query.unsqueeze(3) * keys.unsqueeze(2)).sum(-1) * scale  # [S, kv_heads, group, kv_len]
    scores = scores.masked_fill(~mask, float("-inf"))
    # Softmax normalized after the weighted sum: one division per output, not one per key and output.
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    out = (weights.unsqueeze(-1) * values.unsqueeze(2)).sum(-2)  # [S, kv_heads, group, head_dim]
    return out / weights.sum(-1, keepdim=True)


@dataclass
class SDPAMetadata:
    """Per-step tensors of the ``torch_sdpa`` backend, shared by every layer."""

    slot_mapping: torch.Tensor
    """[tokens] flat cache slot of each new token."""
    block_ids: torch.Tensor
    """[num_seqs * blocks_per_seq] the blocks to gather, sequence after sequence."""
    block_table: torch.Tensor
    """[num_seqs, blocks_per_seq] the same blocks per sequence (compiled graphs gather with it)."""
    seq_lens: torch.Tensor
    """[num_seqs] cached plus new tokens of each sequence (kernels that read the cache in place use it)."""
    num_seqs: int
    """Sequences in the step."""
    kv_len: int
    """Gathered key positions per sequence (whole blocks covering the longest sequence)."""
    max_seq_len: int
    """The longest sequence (compiled decode graphs read only this many of the ``kv_len`` keys)."""
    max_query_len: int
    """Longest query; the padded query length."""
    decode_only: bool
    """Every sequence has exactly one new token (queries need no scatter)."""
    fresh_single_prompt: bool
    """One sequence with nothing cached: plain causal attention over the new tokens."""
    query_index: torch.Tensor | None
    """[tokens] row of each token in the padded ``[num_seqs * max_query_len]`` queries (None for decode)."""
    masks: dict[int | None, torch.Tensor]
    """Sliding window (None = full) → boolean mask ``[num_seqs, 1, max_query_len, kv_len]``, True = visible."""


@dataclass
class SDPASplitMetadata:
    """A step mixing decodes with longer queries, run as two parts (eager only): the decodes and the
    rest, so one-token queries are not padded to the longest."""

    slot_mapping: torch.Tensor
    """[tokens] flat cache slot of each new token (the whole step's keys/values are stored at once)."""
    parts: list[tuple[torch.Tensor, SDPAMetadata]]
    """``(token rows, metadata)`` of each part."""


class TorchSDPABackend(AttentionBackend):
    """Paged attention with torch's ``scaled_dot_product_attention``; runs on any device."""

    name = "torch_sdpa"
    priority = 0
    decode_rows_up_to: ClassVar[int] = 1
    """Longest query run through the decode path as one-token rows (:meth:`ForwardBatch.as_decodes`);
    1: decodes only. Each row reads its sequence's cached keys again, which pays only for short
    queries (speculative verification) and where decode attention is cheaper than the padded path."""

    def build_metadata(self, batch: ForwardBatch,
                       sliding_windows: Iterable[int | None] = (None,)) -> SDPAMetadata | SDPASplitMetadata:
        sliding_windows = tuple(sliding_windows)
        # Compiling first: nothing else may be read then, or dynamo guards on it (and recompiles).
        if not torch.compiler.is_compiling() and batch.max_query_len > 1:
            short = self.decode_rows_up_to
            if batch.max_query_len <= short:
                return self._metadata(batch.as_decodes(), sliding_windows)
            parts = batch.split_decodes(short)
            if parts is not None:
                return SDPASplitMetadata(slot_mapping=batch.slot_mapping, parts=[
                    (rows, self._metadata(part.as_decodes() if part.max_query_len <= short else part, sliding_windows))
                    for rows, part in parts])
        return self._metadata(batch, sliding_windows)

    def _metadata(self, batch: ForwardBatch, sliding_windows: tuple[int | None, ...]) -> SDPAMetadata:
        # A tensor's length rather than len(batch.seq_ids): torch.compile then treats it as dynamic.
        num_seqs, block_size = batch.seq_lens.shape[0], batch.block_size
        blocks = min(-(-batch.max_seq_len // block_size), batch.block_tables.shape[1])
        kv_len = blocks * block_size
        device = batch.positions.device
        max_query_len = batch.max_query_len
        decode_only = max_query_len == 1
        query_index = None
        if decode_only:
            query_positions = batch.positions.view(num_seqs, 1)
        else:
            num_tokens = batch.num_tokens
            starts = batch.query_start_loc[:-1]
            seq_of_token = torch.repeat_interleave(
                torch.arange(num_seqs, device=device), batch.query_lens, output_size=num_tokens
            )
            offset = torch.arange(num_tokens, device=device) - starts[seq_of_token]
            query_index = seq_of_token * max_query_len + offset
            # Padding rows get position 0: they see key 0 only, stay finite, and are dropped afterwards.
            query_positions = batch.positions.new_zeros(num_seqs * max_query_len)
            query_positions = query_positions.index_copy_(0, query_index, batch.positions).view(num_seqs, max_query_len)
        key_positions = torch.arange(kv_len, device=device)
        query_positions = query_positions.unsqueeze(-1)
        causal = key_positions <= query_positions
        masks = {}
        for window in set(sliding_windows):
            mask = causal if window is None else causal & (key_positions > query_positions - window)
            masks[window] = mask.unsqueeze(1)
        return SDPAMetadata(
            slot_mapping=batch.slot_mapping,
            block_ids=batch.block_tables[:, :blocks].reshape(-1),
            block_table=batch.block_tables[:, :blocks],
            seq_lens=batch.seq_lens,
            num_seqs=num_seqs,
            kv_len=kv_len,
            max_seq_len=min(batch.max_seq_len, kv_len),
            max_query_len=max_query_len,
            decode_only=decode_only,
            fresh_single_prompt=num_seqs == 1 and batch.max_seq_len == max_query_len,
            query_index=query_index,
            masks=masks,
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: SDPAMetadata | SDPASplitMetadata,
    ) -> torch.Tensor:
        # The op's dispatch costs ~10 us per layer in eager mode, where the plain write is already in place.
        store = store_kv if torch.compiler.is_compiling() else self.write_kv
        store(kv_cache, metadata.slot_mapping, key, value)
        if not isinstance(metadata, SDPASplitMetadata):
            return self.attend(layer, query, key, value, kv_cache, metadata)
        out = query.new_empty(query.shape[0], layer.num_heads * layer.head_dim)
        for rows, part in metadata.parts:
            # Only a lone fresh prompt's part attends to the new keys/values directly.
            fresh = part.fresh_single_prompt
            new_kv = (key.index_select(0, rows), value.index_select(0, rows)) if fresh else (None, None)
            out.index_copy_(0, rows, self.attend(layer, query.index_select(0, rows), *new_kv, kv_cache, part))
        return out

    def write_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> None:
        """Write a step's ``key``/``value`` (``[tokens, kv_heads, head_dim]``) into ``kv_cache`` at the
        flat slots ``slot_mapping`` (outside compilers). A compile backend may bind a faster write onto
        the instance (``cpu_fused`` does)."""
        _store_kv(kv_cache, slot_mapping, key, value)

    def attend(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
               kv_cache: torch.Tensor, metadata: SDPAMetadata) -> torch.Tensor:
        """Attention of ``query`` (``[tokens, heads, head_dim]``) over the cache for one part of a step
        (the whole step, or its decodes or its other sequences when split), the new keys/values already
        stored; ``key``/``value`` are read only for a lone fresh prompt. Subclasses override this to
        replace some cases (e.g. ``metadata.decode_only``) and call it for the others.

        :returns: ``[tokens, heads * head_dim]``.
        """
        num_tokens = query.shape[0]
        heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if metadata.fresh_single_prompt and layer.sliding_window is None:
            # A batch dimension of 1: on the CPU, 3-D inputs take SDPA's math path (~3× slower than flash).
            out = F.scaled_dot_product_attention(
                query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
                is_causal=True, scale=layer.scale, enable_gqa=heads != kv_heads,
            )
            return out[0].transpose(0, 1).reshape(num_tokens, heads * head_dim)

        num_seqs, kv_len = metadata.num_seqs, metadata.kv_len
        shape = (num_seqs, kv_len, kv_heads, head_dim)
        if torch.compiler.is_compiling():
            # Inductor turns the flat index_select into scalar index arithmetic; this into a vector copy.
            keys, values = key_cache[metadata.block_table], value_cache[metadata.block_table]
        else:
            keys, values = key_cache.index_select(0, metadata.block_ids), value_cache.index_select(0, metadata.block_ids)
        keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
        mask = metadata.masks[layer.sliding_window]

        if metadata.decode_only:
            grouped = query.reshape(num_seqs, kv_heads, heads // kv_heads, head_dim)
            if torch.compiler.is_compiling():
                # The padding of the last block is never visible: its keys are not even read.
                used = metadata.max_seq_len
                out = _decode_attention_reductions(grouped, keys[:, :, :used], values[:, :, :used], mask[..., :used],
                                                   layer.scale)
            else:
                out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=layer.scale)
            return out.reshape(num_tokens, heads * head_dim)

        max_query_len = metadata.max_query_len
        padded = query.new_zeros(num_seqs * max_query_len, heads, head_dim)
        padded.index_copy_(0, metadata.query_index, query)
        padded = padded.view(num_seqs, max_query_len, heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            padded, keys, values, attn_mask=mask, scale=layer.scale, enable_gqa=heads != kv_heads
        )
        out = out.transpose(1, 2).reshape(num_seqs * max_query_len, heads * head_dim)
        return out.index_select(0, metadata.query_index)
