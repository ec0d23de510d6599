"""A minimal step-by-step runner for adapter tests: builds ForwardBatch steps by hand over a paged cache."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from modelrunner.forward_batch import ForwardBatch
from modelrunner.kv_cache.paged import PagedBlockAllocator

Forward = Callable[[ForwardBatch, list[torch.Tensor]], torch.Tensor]
"""``(batch, kv_caches) -> logits``: the forward hook with ``loaded`` bound."""


class PagedDriver:
    """Feeds chunks of tokens of several sequences through ``forward``, keeping their KV in a paged cache.

    Block ids come from the kernel's allocator, so sequences that grow in the same steps get
    interleaved, non-contiguous block tables.
    """

    def __init__(self, forward: Forward, spec, num_blocks: int = 128, max_model_len: int = 512) -> None:
        self.forward = forward
        self.block_size = spec.block_size
        self.kv_caches = [torch.zeros(spec.layer_shape(num_blocks), dtype=spec.dtype) for _ in range(spec.num_layers)]
        self.allocator = PagedBlockAllocator(num_blocks, spec.block_size, max_model_len, enable_prefix_caching=False)
        self.tokens: dict[int, list[int]] = {}

    def build(self, chunks: Mapping[int, Sequence[int]], all_logits: bool = False) -> ForwardBatch:
        """The batch that computes ``chunks`` (seq id → its next tokens), allocating their slots."""
        ids, positions, slots, starts, seq_lens, ctx_lens, tables, last = [], [], [], [0], [], [], [], []
        for seq_id, new in chunks.items():
            new = list(new)
            if seq_id not in self.tokens:
                assert self.allocator.allocate(seq_id, new) == 0
                self.tokens[seq_id] = []
            else:
                assert self.allocator.append_slots(seq_id, new) == []
            start = len(self.tokens[seq_id])
            self.tokens[seq_id] += new
            end = start + len(new)
            ids += new
            positions += range(start, end)
            slots += self.allocator.slot_mapping(seq_id, start, end)
            starts.append(starts[-1] + len(new))
            ctx_lens.append(start)
            seq_lens.append(end)
            tables.append(self.allocator.block_table(seq_id))
            last.append(starts[-1] - 1)
        width = max(len(t) for t in tables)
        long = dict(dtype=torch.int64)
        return ForwardBatch(
            input_ids=torch.tensor(ids, **long),
            positions=torch.tensor(positions, **long),
            seq_ids=tuple(chunks),
            query_start_loc=torch.tensor(starts, **long),
            seq_lens=torch.tensor(seq_lens, **long),
            context_lens=torch.tensor(ctx_lens, **long),
            slot_mapping=torch.tensor(slots, **long),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **long),
            logits_indices=torch.arange(len(ids)) if all_logits else torch.tensor(last, **long),
            block_size=self.block_size,
            max_query_len=max(len(c) for c in chunks.values()),
            max_seq_len=max(seq_lens),
        )

    def step(self, chunks: Mapping[int, Sequence[int]], all_logits: bool = False) -> torch.Tensor:
        """Run one step; logits of every new token (``all_logits``) or of each sequence's last one."""
        return self.forward(self.build(chunks, all_logits), self.kv_caches)

    def greedy(self, prompts: Mapping[int, Sequence[int]], max_new_tokens: int,
               suppress: Sequence[int] = ()) -> dict[int, list[int]]:
        """Prefill every prompt in one step, then decode all sequences together; the greedy tokens.

        :param suppress: token ids never chosen (like transformers' ``min_new_tokens`` does to EOS).
        """
        out = {seq_id: [] for seq_id in prompts}
        logits = self.step(prompts)
        for i in range(max_new_tokens):
            if suppress:
                logits[:, list(suppress)] = float("-inf")
            next_ids = logits.argmax(-1).tolist()
            for seq_id, token in zip(prompts, next_ids):
                out[seq_id].append(token)
            if i + 1 < max_new_tokens:
                logits = self.step({seq_id: [out[seq_id][-1]] for seq_id in prompts})
        return out
