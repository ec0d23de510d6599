"""modelrunner plugin: the ``draft`` proposer — a small model of the same vocabulary proposes greedily, with its own executor and KV cache.

Per sequence, the draft keeps the KV of the tokens it was given (the sequence's real tokens); each
step it computes the tokens added since (the accepted proposals and the target's token) as one
chunk, then decodes ``num_tokens`` greedy guesses into lookahead slots of its own allocator, which
it gives back right after, so its cache only ever holds real tokens. All sequences of a step share
each of the draft's forwards.

It is written against ``modelrunner.api`` alone, like any proposer plugin: a proposer that runs a
model of its own needs nothing else from the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from modelrunner.api import (ForwardBatch, PagedBlockAllocator, ProposalRequest, Proposer, ProposerContext, RunnerConfig,
                             create_executor, hookimpl)

__all__ = ["DraftModelProposer", "register"]


class DraftModelProposer(Proposer):
    """vLLM's draft-model speculation (``{"model": path, "num_speculative_tokens": k}``).

    :raises ValueError: no ``model``, a checkpoint no adapter loads, or a vocabulary that differs
        from the target's (size or tokens).
    """

    name = "draft"

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        spec = context.config
        if spec.model is None:
            raise ValueError("speculative_config: the draft proposer needs 'model' (the draft checkpoint's path)")
        target = context.runner_config
        settings = {"model": spec.model}
        if target is not None:
            settings.update(device=target.device, dtype=target.model.dtype, seed=target.model.seed,
                            max_model_len=target.model.max_model_len, block_size=target.cache.block_size,
                            kv_cache_memory=target.cache.kv_cache_memory)
        try:
            executor = create_executor(RunnerConfig.from_dict({k: v for k, v in settings.items() if v is not None}),
                                       context.plugins)
            executor.load_model()
        except Exception as exc:  # noqa: BLE001 - say which model failed
            raise ValueError(f"speculative_config: the draft model {spec.model!r} could not be loaded: "
                             f"{type(exc).__name__}: {exc}") from None
        self.executor = executor
        """Runs the draft model."""
        self._check_vocabulary(executor, context)
        if executor.kv_cache_spec is None:
            executor.shutdown()
            raise ValueError(f"speculative_config: the draft model {spec.model!r} keeps its own cache; a draft "
                             "needs one on the paged KV cache")
        self.allocator = PagedBlockAllocator(executor.num_blocks, executor.block_size, executor.max_model_len,
                                             enable_prefix_caching=False)
        """The draft's own KV blocks."""
        executor.lend_allocator(self.allocator)
        self._computed: dict[int, int] = {}  # seq id → tokens whose KV the draft holds
        self.num_forwards = 0
        """Draft forwards run so far."""

    @staticmethod
    def _check_vocabulary(executor, context: ProposerContext) -> None:
        draft_vocab = executor.loaded.vocab_size
        problem = None
        if draft_vocab != context.vocab_size:
            problem = f"its vocabulary has {draft_vocab} tokens, the target's {context.vocab_size}"
        elif context.tokenizer is not None and executor.tokenizer is not None:
            if context.tokenizer.get_vocab() != executor.tokenizer.get_vocab():
                problem = "its tokenizer maps tokens to other ids than the target's"
        if problem is not None:
            executor.shutdown()
            raise ValueError(f"speculative_config: the draft model {context.config.model!r} cannot propose for this "
                             f"target: {problem} (a draft must share the target's tokenizer vocabulary)")

    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        """Catch each sequence up on its new tokens, then decode greedy guesses, all sequences at once."""
        alloc = self.allocator
        live: list[ProposalRequest] = []
        for r in requests:
            tokens = list(r.token_ids)
            if r.seq_id not in alloc:
                if not alloc.can_allocate(tokens):
                    continue  # no room in the draft's cache: this sequence goes without a guess
                alloc.allocate(r.seq_id, tokens)
                self._computed[r.seq_id] = 0
            else:
                have = alloc.num_tokens(r.seq_id)
                if len(tokens) > have:
                    if not alloc.can_append(r.seq_id, len(tokens) - have):
                        continue
                    alloc.append_slots(r.seq_id, tokens[have:])
            if not alloc.reserve_lookahead(r.seq_id, r.num_tokens - 1):
                continue  # its tokens have slots now; their KV is computed on a later step
            live.append(r)
        out: dict[int, list[int]] = {r.seq_id: [] for r in requests}
        if not live:
            return [out[r.seq_id] for r in requests]
        # The catch-up chunk: the tokens added since the last step; its last row gives the first guess.
        starts = [self._computed[r.seq_id] for r in live]
        chunks = [list(r.token_ids[s:]) for r, s in zip(live, starts)]
        guesses = self._forward(live, chunks, starts)
        for r, g in zip(live, guesses):
            self._computed[r.seq_id] = len(r.token_ids)
            out[r.seq_id].append(g)
        step = 1
        while True:
            going = [r for r in live if len(out[r.seq_id]) < r.num_tokens]
            if not going:
                break
            guesses = self._forward(going, [[out[r.seq_id][-1]] for r in going],
                                    [len(r.token_ids) + step - 1 for r in going])
            for r, g in zip(going, guesses):
                out[r.seq_id].append(g)
            step += 1
        for r in live:
            alloc.release_lookahead(r.seq_id)
        return [out[r.seq_id] for r in requests]

    def _forward(self, requests: list[ProposalRequest], chunks: list[list[int]], starts: list[int]) -> list[int]:
        """The draft's argmax after each chunk."""
        batch = ForwardBatch.build([r.seq_id for r in requests], chunks, starts,
                                   [self.allocator.block_table(r.seq_id) for r in requests], self.allocator.block_size,
                                   [[len(c) - 1] for c in chunks])
        self.num_forwards += 1
        logits = self.executor.execute_model(batch).logits
        return torch.argmax(logits[:, :self.context.vocab_size].float(), dim=-1).tolist()

    def forget(self, seq_ids: Sequence[int]) -> None:
        """Free the draft's blocks of sequences that ended or were preempted."""
        for seq_id in seq_ids:
            self._computed.pop(seq_id, None)
            if seq_id in self.allocator:
                self.allocator.free(seq_id)

    def stats(self) -> dict:
        """The draft's forwards and KV blocks in use."""
        return {"draft_forwards": self.num_forwards, "draft_kv_used_blocks": self.allocator.stats().used_blocks}


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``draft`` proposer."""
    registry.proposers(DraftModelProposer)
