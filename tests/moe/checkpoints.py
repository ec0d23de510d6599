"""Tiny random MoE checkpoints of each architecture, written in any of the expert layouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)

CONFIGS = {
    # Every layer sparse, top-2 of 4, always renormalised.
    "mixtral": lambda **kw: MixtralConfig(**TINY, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                                          tie_word_embeddings=False, **kw),
    # decoder_sparse_step=2: layer 0 dense, layer 1 sparse with the gated shared expert; q/k/v biases; not renormalised.
    "qwen2_moe": lambda **kw: Qwen2MoeConfig(**TINY, intermediate_size=96, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                             decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
                                             tie_word_embeddings=False, **kw),
    # 3 layers, layer 1 dense (mlp_only_layers); q/k norm; renormalised top-2 of 8; tied embeddings.
    "qwen3_moe": lambda **kw: Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 3}, head_dim=16, intermediate_size=96,
                                             moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                             decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
                                             tie_word_embeddings=True, **kw),
}
"""Architecture name → config factory (keyword arguments override, e.g. ``vocab_size``)."""

ARCHITECTURE = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def make_config(name: str, **overrides: Any):
    """The tiny config ``name`` with ``architectures`` set."""
    config = CONFIGS[name](**{"vocab_size": 128, **overrides})
    config.architectures = [ARCHITECTURE[name]]
    return config


def make_reference(config, seed: int = 0):
    """A transformers model for ``config`` with every weight random and non-trivial (norms near 1)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.1 * torch.randn_like(p))
    return model


def save_fused_layout(model, path: Path) -> Path:
    """Write ``model`` with transformers 5's in-memory names: fused ``experts.gate_up_proj`` / ``down_proj``."""
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(path))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def save_checkpoint(model, path: Path, layout: str = "per_expert", tokenizer=None) -> Path:
    """Save ``model`` to ``path`` with its experts ``"per_expert"`` (what ``save_pretrained`` writes) or ``"fused"``."""
    if layout == "fused":
        save_fused_layout(model, path)
    else:
        model.save_pretrained(str(path))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
