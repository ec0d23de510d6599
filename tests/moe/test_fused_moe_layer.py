"""The kernel's FusedMoE layer and router: transformers' semantics, expert-parallel shares, weight layouts, cost."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import MixtralConfig, Qwen2MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

from modelrunner.layers.fused_moe import FusedMoE, expert_tensor_name, fused_experts
from modelrunner.layers.moe_router import check_top_k, select_experts

H, I = 32, 48


def _layer(num_experts: int, top_k: int, renormalize: bool = True, seed: int = 0, **tp) -> FusedMoE:
    torch.manual_seed(seed)
    layer = FusedMoE(num_experts, top_k, H, I, renormalize, **tp)
    full13 = torch.randn(num_experts, 2 * I, H) * 0.1
    full2 = torch.randn(num_experts, H, I) * 0.1
    layer.w13_weight.weight_loader(layer.w13_weight, full13)
    layer.w2_weight.weight_loader(layer.w2_weight, full2)
    return layer


def _token_by_token(hidden, w13, w2, weights, ids):
    """The definition, one token and one chosen expert at a time."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = F.linear(hidden[t], w13[e]).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, w2[e])
    return out


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (9, 8, 2), (33, 8, 3), (5, 16, 1), (0, 4, 2)])
def test_fused_experts_is_the_weighted_sum_of_the_chosen_experts(num_tokens, num_experts, top_k):
    layer = _layer(num_experts, top_k)
    hidden = torch.randn(num_tokens, H)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts), top_k, renormalize=True)
    got = fused_experts(hidden, layer.w13_weight, layer.w2_weight, weights, ids)
    expected = _token_by_token(hidden, layer.w13_weight, layer.w2_weight, weights, ids)
    assert got.shape == (num_tokens, H)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_matches_transformers_routers(renormalize):
    logits_in = torch.randn(20, H)
    if renormalize:
        router = MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2))
    else:
        router = Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=H, num_experts=8, num_experts_per_tok=2,
                                                   norm_topk_prob=False))
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, H))
        router_logits, their_weights, their_ids = router(logits_in)
    weights, ids = select_experts(router_logits, 2, renormalize)
    assert torch.equal(ids, their_ids)
    torch.testing.assert_close(weights, their_weights.float(), rtol=0, atol=0)
    assert torch.allclose(weights.sum(-1), torch.ones(20)) == renormalize


def test_layer_matches_transformers_mixtral_experts():
    config = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=8, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    theirs = MixtralExperts(config)
    ours = _layer(8, 2)
    with torch.no_grad():
        theirs.gate_up_proj.copy_(ours.w13_weight)
        theirs.down_proj.copy_(ours.w2_weight)
    hidden, router_logits = torch.randn(40, H), torch.randn(40, 8)
    weights, ids = select_experts(router_logits, 2, renormalize=True)
    with torch.no_grad():
        expected = theirs(hidden, ids, weights)
    torch.testing.assert_close(ours(hidden, router_logits), expected, rtol=1e-5, atol=1e-6)


def test_expert_parallel_shares_sum_to_the_whole_layer():
    full = _layer(8, 2)
    hidden, router_logits = torch.randn(17, H), torch.randn(17, 8)
    full_out = full(hidden, router_logits)
    shares = []
    for rank in range(4):
        part = _layer(8, 2, tp_rank=rank, tp_size=4, reduce_results=False)
        assert part.w13_weight.shape == (2, 2 * I, H) and part.expert_start == 2 * rank
        torch.testing.assert_close(part.w13_weight, full.w13_weight[2 * rank:2 * rank + 2], rtol=0, atol=0)
        shares.append(part(hidden, router_logits))
        # Every rank routes (and counts) every token, for all experts.
        assert part.last_expert_token_counts == full.last_expert_token_counts
    assert all(p.abs().sum() > 0 for p in shares)
    torch.testing.assert_close(sum(shares), full_out, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"num_experts \(8\) is not divisible by the tensor-parallel size \(3\)"):
        FusedMoE(8, 2, H, I, True, tp_rank=0, tp_size=3)


def test_per_expert_tensors_load_like_the_fused_ones():
    fused = _layer(4, 2)
    per_expert = FusedMoE(4, 2, H, I, True)
    mapping = FusedMoE.packed_modules_mapping(4)
    assert mapping["w13_weight"][:3] == ["expert0_gate_proj", "expert0_up_proj", "expert1_gate_proj"]
    assert mapping["w2_weight"][3] == expert_tensor_name(3, "down_proj") == "expert3_down_proj"
    for e in range(4):
        gate, up = fused.w13_weight[e].split(I)
        per_expert.w13_weight.weight_loader(per_expert.w13_weight, gate.clone(), 2 * e)
        per_expert.w13_weight.weight_loader(per_expert.w13_weight, up.clone(), 2 * e + 1)
        per_expert.w2_weight.weight_loader(per_expert.w2_weight, fused.w2_weight[e].clone(), e)
    assert torch.equal(per_expert.w13_weight, fused.w13_weight) and torch.equal(per_expert.w2_weight, fused.w2_weight)
    with pytest.raises(ValueError, match=r"expected shape \[48, 32\] for expert 1, got \[32, 48\]"):
        per_expert.w13_weight.weight_loader(per_expert.w13_weight, torch.zeros(H, I), 2)
    with pytest.raises(ValueError, match=r"expected shape \[4, 96, 32\], got \[3, 96, 32\]"):
        per_expert.w13_weight.weight_loader(per_expert.w13_weight, torch.zeros(3, 2 * I, H))
    with pytest.raises(ValueError, match="shard_id must be an index below 4, got 4"):
        per_expert.w2_weight.weight_loader(per_expert.w2_weight, torch.zeros(H, I), 4)


MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.mkldnn._linear_pointwise}


class _CountMatmuls(TorchDispatchMode):
    """Counts the matrix products torch actually dispatches."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in MATMULS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("num_tokens", [1, 3, 64])
def test_cost_follows_tokens_times_top_k_not_experts(num_tokens):
    layer = _layer(64, 2)
    hidden = torch.randn(num_tokens, H)
    router_logits = torch.randn(num_tokens, 64)
    weights, ids = select_experts(router_logits, 2, renormalize=True)
    with _CountMatmuls() as count:
        fused_experts(hidden, layer.w13_weight, layer.w2_weight, weights, ids)
    # Two matmuls per expert that received tokens, none for the others.
    assert count.calls == 2 * len(set(ids.flatten().tolist())) <= 2 * min(64, 2 * num_tokens)


def test_top_k_must_fit_the_experts():
    with pytest.raises(ValueError, match=r"top_k=5 experts per token is not possible with num_experts=4; "
                                         r"top_k must be between 1 and 4"):
        FusedMoE(4, 5, H, I, True)
    with pytest.raises(ValueError, match="top_k=0"):
        check_top_k(0, 4)
    with pytest.raises(ValueError, match="num_experts must be at least 1"):
        check_top_k(1, 0)
    with pytest.raises(ValueError, match="router_logits has 5 experts, the layer 4"):
        _layer(4, 2)(torch.randn(2, H), torch.randn(2, 5))
