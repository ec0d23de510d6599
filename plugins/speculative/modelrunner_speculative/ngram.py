"""``ngram``: prompt lookup decoding — copy what followed the last occurrence of the sequence's tail."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from modelrunner.api import ProposalRequest, Proposer, ProposerContext


def ngram_proposal(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The ``k`` tokens that followed the latest earlier occurrence of the sequence's last ``n`` tokens,
    for the longest ``n`` in ``max_n … min_n`` that occurs (fewer near the end; [] when none occurs)."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = arr[length - n:]
        # Windows starting at 0 … length - n - 1 (the tail itself excluded), latest first.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Prompt lookup (vLLM's ``ngram`` method): no model, no state; works where the output copies its
    input (editing code, quoting, summarising with the source's words) and proposes nothing elsewhere."""

    name = "ngram"

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.min_n = context.config.prompt_lookup_min
        """Shortest tail looked up."""
        self.max_n = context.config.prompt_lookup_max
        """Longest tail looked up (tried first)."""

    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        """One lookup per request."""
        return [ngram_proposal(r.token_ids, self.min_n, self.max_n, r.num_tokens) for r in requests]
