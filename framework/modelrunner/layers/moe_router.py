"""Routing tokens to experts: a router's logits → each token's top-k experts and their mixing weights.

The rule every softmax-routed MoE in transformers follows (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE …):
softmax over all experts in float32, keep the ``top_k`` largest probabilities, and — when the
architecture says so — renormalise those ``top_k`` weights to sum to one. Mixtral always
renormalises; the Qwen MoE models do when their config's ``norm_topk_prob`` is set.
"""

from __future__ import annotations

import torch


def check_top_k(top_k: int, num_experts: int, what: str = "MoE layer") -> None:
    """Raise unless ``1 <= top_k <= num_experts``.

    :param what: names the model or layer in the message.
    :raises ValueError: naming both values and the accepted range.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or isinstance(num_experts, bool) \
            or not isinstance(num_experts, int):
        raise ValueError(f"{what}: top_k and num_experts must be integers, got top_k={top_k!r}, "
                         f"num_experts={num_experts!r}")
    if num_experts < 1:
        raise ValueError(f"{what}: num_experts must be at least 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{what}: top_k={top_k} experts per token is not possible with num_experts={num_experts}; "
                         f"top_k must be between 1 and {num_experts}")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights, from the router's logits.

    :param router_logits: ``[num_tokens, num_experts]`` in the model's dtype.
    :param top_k: experts per token.
    :param renormalize: divide the kept probabilities by their sum (Mixtral; Qwen with ``norm_topk_prob``).
    :returns: ``(topk_weights, topk_ids)``, both ``[num_tokens, top_k]``: float32 weights (largest
        first) and int64 expert ids.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
