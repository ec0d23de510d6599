"""RoPE (default, linear, llama3) and RMSNorm against transformers' Llama implementations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from modelrunner.layers import RMSNorm, RotaryEmbedding, rope_parameters

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rotary_matches_transformers(kind):
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters=ROPES[kind])
    theirs = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding.from_config(config, head_dim=32, max_position=512)
    positions = torch.tensor([0, 1, 7, 63, 64, 100, 511, 3])
    q, k = torch.randn(len(positions), 4, 32), torch.randn(len(positions), 2, 32)
    cos, sin = theirs(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = ours(positions, q, k)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_legacy_rope_attributes_are_read():
    legacy = SimpleNamespace(rope_theta=250000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(legacy) == {"rope_type": "linear", "rope_theta": 250000.0, "factor": 2.0}
    assert rope_parameters(SimpleNamespace()) == {"rope_type": "default", "rope_theta": 10000.0}
    # Linear scaling by 2 is position p of the unscaled rotation at p / 2.
    scaled = RotaryEmbedding(16, 64, rope_parameters(legacy))
    plain = RotaryEmbedding(16, 64, {"rope_type": "default", "rope_theta": 250000.0})
    x = torch.randn(3, 1, 16)
    torch.testing.assert_close(scaled.rotate(torch.tensor([2, 10, 40]), x), plain.rotate(torch.tensor([1, 5, 20]), x))


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'; supported: default, linear, llama3"):
        RotaryEmbedding(16, 8, {"rope_type": "yarn", "rope_theta": 1.0})


def test_rmsnorm_matches_transformers_with_fused_residual():
    theirs = LlamaRMSNorm(48, eps=1e-5)
    ours = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.weight.copy_(theirs.weight)
    x, residual = torch.randn(5, 48), torch.randn(5, 48)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-6)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, theirs(x + residual), atol=1e-6, rtol=1e-6)
    half = ours.to(torch.bfloat16)(x.bfloat16())
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), theirs(x), atol=0.05, rtol=0.02)
