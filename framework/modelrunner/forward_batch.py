"""The description of one model step that the kernel hands to an adapter's forward hook."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from .wire import register as _wire_type


RETURN_HIDDEN_STATES = "return_hidden_states"
"""``ForwardBatch.extra`` key: an int64 tensor of rows of the step's flattened tokens whose final hidden
states (after the model's final norm) the forward hook must return in ``aux[HIDDEN_STATES]``, in that
order. Set when embedding (pooling) requests run in the step; absent otherwise."""
HIDDEN_STATES = "hidden_states"
"""``ForwardOutput.aux`` key: float ``[len(rows), hidden_size]``, the final hidden states of the rows
``extra[RETURN_HIDDEN_STATES]`` asked for (an adapter that does not return them cannot serve embeddings)."""


@_wire_type
@attrs.frozen
class ForwardBatch:
    """The flattened tokens of every sequence scheduled in one step.

    Sequences are laid end to end: sequence ``i`` owns the token range
    ``query_start_loc[i]:query_start_loc[i + 1]`` of ``input_ids``/``positions``/``slot_mapping``.
    Its first ``context_lens[i]`` tokens are already in the KV cache (prefix hits or earlier steps);
    the new ones are the query tokens. ``seq_lens[i] == context_lens[i] + query_lens[i]``.
    """

    input_ids: torch.Tensor
    """[num_tokens] int64 token ids of the new tokens of every sequence, concatenated."""
    positions: torch.Tensor
    """[num_tokens] int64 position of each new token inside its own sequence."""
    seq_ids: tuple[int, ...]
    """Engine id of each sequence, in batch order (adapters that keep per-sequence state key it by this)."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int64 cumulative query lengths; the offsets of each sequence's new tokens."""
    seq_lens: torch.Tensor
    """[num_seqs] int64 total tokens of each sequence after this step (cached + new)."""
    context_lens: torch.Tensor
    """[num_seqs] int64 tokens of each sequence already in the cache before this step."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64 flat cache slot (``block_id * block_size + offset``) where each new token's K/V goes."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int64 block ids of each sequence, padded with 0 past its last block."""
    logits_indices: torch.Tensor
    """[num_samples] int64 rows of the flattened tokens whose logits are wanted (usually each
    sequence's last token)."""
    block_size: int
    """Tokens per KV-cache block."""
    max_query_len: int
    """Longest query among the sequences (1 in a pure decode step)."""
    max_seq_len: int
    """Longest ``seq_lens`` entry."""
    finished_seq_ids: tuple[int, ...] = ()
    """Sequences that ended since the previous step, so adapters that keep per-sequence state can drop it."""
    extra: dict[str, Any] = attrs.field(factory=dict)
    """Adapter-specific inputs keyed by name (e.g. ``"images"``, ``"return_router_logits"``)."""
    lora_ids: tuple[int, ...] = ()
    """Each sequence's LoRA adapter id (``lora_int_id``; 0: the base model); empty: all base model."""
    loras: dict[int, Any] = attrs.field(factory=dict)
    """The step's adapters by id (:class:`~modelrunner.lora.LoRARequest`), so every rank can read them."""

    @classmethod
    def build(cls, seq_ids: Sequence[int], new_tokens: Sequence[Sequence[int]], starts: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int, logits_rows: Sequence[Sequence[int]],
              finished_seq_ids: tuple[int, ...] = (), extra: dict[str, Any] | None = None) -> ForwardBatch:
        """Flatten sequences into one batch with a handful of tensor operations.

        :param seq_ids: each sequence's id; ``new_tokens`` its tokens computed in this step, which
            follow its first ``starts[i]`` (cached) tokens; ``block_tables`` its blocks.
        :param logits_rows: per sequence, the offsets (into its new tokens) whose logits are wanted.
        """
        if not seq_ids:
            raise ValueError("cannot build a forward batch from zero sequences")
        num_seqs = len(seq_ids)
        query_lens = [len(t) for t in new_tokens]
        max_blocks = max(len(t) for t in block_tables)
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
        if min(query_lens) == max(query_lens) == 1:
            return cls._build_decode(seq_ids, new_tokens, starts, padded, block_size, logits_rows,
                                     finished_seq_ids, extra)
        tables = torch.tensor(padded, dtype=torch.long)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        context_lens = torch.tensor(list(starts), dtype=torch.long)
        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        max_query_len = max(query_lens)
        if max_query_len == 1:
            positions = context_lens.clone()
            seq_index = torch.arange(num_seqs)
        else:
            seq_index = torch.repeat_interleave(torch.arange(num_seqs), q_lens, output_size=num_tokens)
            positions = torch.arange(num_tokens) + (context_lens - query_start_loc[:-1])[seq_index]
        slot_mapping = tables[seq_index, positions // block_size] * block_size + positions % block_size
        seq_lens = context_lens + q_lens
        offsets = query_start_loc[:-1].tolist()
        logits_indices = [offsets[i] + r for i, rows in enumerate(logits_rows) for r in rows]
        return cls(
            input_ids=torch.tensor([t for tokens in new_tokens for t in tokens], dtype=torch.long),
            positions=positions,
            seq_ids=tuple(seq_ids),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            context_lens=context_lens,
            slot_mapping=slot_mapping,
            block_tables=tables,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long),
            block_size=block_size,
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            finished_seq_ids=tuple(finished_seq_ids),
            extra=extra or {},
        )

    @classmethod
    def _build_decode(cls, seq_ids: Sequence[int], new_tokens: Sequence[Sequence[int]], starts: Sequence[int],
                      tables: list[list[int]], block_size: int, logits_rows: Sequence[Sequence[int]],
                      finished_seq_ids: tuple[int, ...], extra: dict[str, Any] | None) -> ForwardBatch:
        """:meth:`build` of a decode step (one new token per sequence): the same batch from Python
        lists, a tensor apiece (a single-sequence decode step spent ~70 µs in tensor ops here)."""
        positions = [int(p) for p in starts]
        for i, p in enumerate(positions):
            if not 0 <= p // block_size < len(tables[i]):
                raise ValueError(f"sequence {seq_ids[i]}'s position {p} is past its block table "
                                 f"({len(tables[i])} blocks of {block_size})")
        long = torch.long
        lengths = [p + 1 for p in positions]
        return cls(
            input_ids=torch.tensor([tokens[0] for tokens in new_tokens], dtype=long),
            positions=torch.tensor(positions, dtype=long),
            seq_ids=tuple(seq_ids),
            query_start_loc=torch.arange(len(positions) + 1),
            seq_lens=torch.tensor(lengths, dtype=long),
            context_lens=torch.tensor(positions, dtype=long),
            slot_mapping=torch.tensor([table[p // block_size] * block_size + p % block_size
                                       for table, p in zip(tables, positions)], dtype=long),
            block_tables=torch.tensor(tables, dtype=long),
            logits_indices=torch.tensor([i + r for i, rows in enumerate(logits_rows) for r in rows], dtype=long),
            block_size=block_size,
            max_query_len=1,
            max_seq_len=max(lengths),
            finished_seq_ids=tuple(finished_seq_ids),
            extra=extra or {},
        )

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the step."""
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        """Number of new tokens in the step."""
        return int(self.input_ids.shape[0])

    @property
    def query_lens(self) -> torch.Tensor:
        """[num_seqs] new tokens per sequence."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence contributes exactly one new token."""
        return self.max_query_len == 1

    def token_rows(self, seqs: torch.Tensor) -> torch.Tensor:
        """[tokens] rows of the flattened tokens that belong to the sequences ``seqs`` (ascending
        batch indices), in batch order."""
        chosen = torch.zeros(self.num_seqs, dtype=torch.bool, device=seqs.device).index_fill_(0, seqs, True)
        return torch.repeat_interleave(chosen, self.query_lens, output_size=self.num_tokens).nonzero().flatten()

    def select(self, seqs: torch.Tensor) -> ForwardBatch:
        """The step of the sequences ``seqs`` alone (ascending batch indices): their tokens, lengths and
        block tables, and those of ``logits_indices`` that fall on their tokens, renumbered.
        ``finished_seq_ids`` and ``extra`` are kept as they are."""
        return self._pick(seqs)[1]

    def split_decodes(self, up_to: int = 1) -> list[tuple[torch.Tensor, ForwardBatch]] | None:
        """A step holding both decodes and longer queries as two parts, ``(token rows, step)`` of its
        decodes and of its other sequences; None when it holds only one kind. A decode has at most
        ``up_to`` new tokens (1: exactly one; more: speculative verifications count too)."""
        decodes = self.query_lens <= up_to
        if self.num_seqs < 2 or not bool(decodes.any()) or bool(decodes.all()):
            return None
        return [self._pick(seqs) for seqs in (decodes.nonzero().flatten(), (~decodes).nonzero().flatten())]

    def as_decodes(self) -> ForwardBatch:
        """The same step with each new token as a one-token sequence of its own, which sees its
        sequence's cache up to and including itself (a step stores all its keys/values before
        attending): how an attention backend runs short queries, such as a speculative
        verification's ``1 + k`` tokens, through its decode path. Tokens, slots and
        ``logits_indices`` keep their rows; ``seq_ids``, ``lora_ids`` and block tables repeat per token."""
        if self.max_query_len == 1:
            return self
        num_tokens = self.num_tokens
        seq_index = torch.repeat_interleave(torch.arange(self.num_seqs, device=self.positions.device),
                                            self.query_lens, output_size=num_tokens)
        picked = seq_index.tolist()
        return attrs.evolve(
            self,
            seq_ids=tuple(self.seq_ids[i] for i in picked),
            lora_ids=tuple(self.lora_ids[i] for i in picked) if self.lora_ids else (),
            query_start_loc=torch.arange(num_tokens + 1, device=self.positions.device),
            seq_lens=self.positions + 1,
            context_lens=self.positions.clone(),
            block_tables=self.block_tables.index_select(0, seq_index),
            max_query_len=1,
        )

    def _pick(self, seqs: torch.Tensor) -> tuple[torch.Tensor, ForwardBatch]:
        rows = self.token_rows(seqs)
        query_lens = self.query_lens.index_select(0, seqs)
        seq_lens = self.seq_lens.index_select(0, seqs)
        new_row = torch.full((self.num_tokens,), -1, dtype=torch.long, device=rows.device)
        new_row[rows] = torch.arange(len(rows), device=rows.device)
        logits_rows = new_row.index_select(0, self.logits_indices)
        picked = seqs.tolist()
        return rows, attrs.evolve(
            self,
            input_ids=self.input_ids.index_select(0, rows),
            positions=self.positions.index_select(0, rows),
            seq_ids=tuple(self.seq_ids[i] for i in picked),
            lora_ids=tuple(self.lora_ids[i] for i in picked) if self.lora_ids else (),
            query_start_loc=torch.cat((query_lens.new_zeros(1), query_lens.cumsum(0))),
            seq_lens=seq_lens,
            context_lens=self.context_lens.index_select(0, seqs),
            slot_mapping=self.slot_mapping.index_select(0, rows),
            block_tables=self.block_tables.index_select(0, seqs),
            logits_indices=logits_rows[logits_rows >= 0],
            max_query_len=int(query_lens.max()) if picked else 0,
            max_seq_len=int(seq_lens.max()) if picked else 0,
        )

    def to(self, device: torch.device) -> ForwardBatch:
        """The same batch with its tensors on ``device`` (this batch itself when they all are)."""
        device = torch.device(device)
        tensors = {}
        for f in attrs.fields(type(self)):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.device != device:
                tensors[f.name] = value.to(device, non_blocking=True)
        return attrs.evolve(self, **tensors) if tensors else self


@attrs.frozen
class ForwardOutput:
    """What a forward hook may return instead of a bare logits tensor, to pass extra outputs along."""

    logits: torch.Tensor
    """[len(batch.logits_indices), vocab] logits, as the bare-tensor form."""
    aux: dict[str, Any] = attrs.field(factory=dict)
    """Named extra outputs of the step (e.g. ``"router_logits"``: one ``[num_tokens, num_experts]``
    tensor per MoE layer; ``"stage_outputs"`` on a pipeline stage before the last)."""
