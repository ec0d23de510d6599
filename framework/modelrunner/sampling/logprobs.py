"""Log-probabilities of chosen and top tokens, computed from the model's raw logits (as vLLM does)."""

from __future__ import annotations

import attrs
import torch

from ..wire import register as _wire_type


@_wire_type
@attrs.frozen
class Logprob:
    """The log-probability of one token at one position (vLLM's ``Logprob``)."""

    logprob: float
    """Natural log of the token's probability under the model's raw logits."""
    rank: int | None = None
    """1 for the most likely token, 2 for the next, …"""
    decoded_token: str | None = None
    """The token's text (None when the model has no tokenizer)."""


PositionLogprobs = dict[int, Logprob]
"""token id → its :class:`Logprob` at one position: the top tokens plus the chosen one."""


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row: the chosen token's log-probability and rank (1 = most likely), and the ``k``
    most likely tokens with their log-probabilities.

    :param logits: ``[R, V]`` raw logits.
    :param chosen: ``[R]`` int64 token ids.
    :returns: ``(chosen_logprob [R], chosen_rank [R], top_ids [R, k], top_logprobs [R, k])``.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, chosen.view(-1, 1)).squeeze(1)
    rank = (logprobs > picked.unsqueeze(1)).sum(dim=1) + 1
    top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1) if k > 0 else None
    if top is None:
        empty = logits.new_empty(logits.shape[0], 0)
        return picked, rank, empty.long(), empty.float()
    return picked, rank, top.indices, top.values
