"""Verification of proposed tokens against the target model's distributions."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rejection_sample(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None = None,
                     draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens to emit after checking ``draft`` against the target: the accepted drafts, then one
    token from the target (from the residual at the first rejection, else the bonus row).

    Draft token ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first
    rejection the token is drawn from ``normalize(max(p_j - q_j, 0))``. Every emitted token is then
    distributed exactly as the target's own sampling would be (Leviathan et al., 2023). Without
    ``draft_probs`` the proposals are point masses (``q_j = one-hot(d_j)``, as for ``ngram``).

    :param probs: ``[k + 1, V]`` the target's probabilities at the last real token and each draft.
    :param draft: the ``k`` proposed tokens.
    :param generator: where the random numbers come from (None: torch's default).
    :param draft_probs: ``[k, V]`` the proposer's distributions, when it sampled from one.
    """
    k = len(draft)
    if probs.shape[0] != k + 1:
        raise ValueError(f"probs must have len(draft) + 1 = {k + 1} rows, got {probs.shape[0]}")
    probs = probs.float().cpu()
    uniform = torch.rand(k, generator=generator) if k else None
    out: list[int] = []
    for j, token in enumerate(draft):
        p = probs[j]
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        if q_token > 0 and float(uniform[j]) * q_token < float(p[token]):
            out.append(int(token))
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[j].float().cpu()).clamp_min_(0.0)
        if float(residual.sum()) <= 0.0:
            residual = p  # p equals q here: any draw from p is right
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return out


def greedy_accept(target: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The tokens to emit when decoding greedily: the longest prefix of ``draft`` that matches the
    target's argmax ``target`` (``k + 1`` tokens), then the target's token after it."""
    out: list[int] = []
    for j, token in enumerate(draft):
        out.append(int(target[j]))
        if int(token) != int(target[j]):
            return out
    out.append(int(target[len(draft)]))
    return out
