"""What differs between the MoE architectures, read once from their transformers configs.

transformers 5.24 defines the three rules this adapter follows:

- Mixtral: every layer sparse; softmax → top-k, always renormalised; no shared expert; no biases.
- Qwen2-MoE: layer ``i`` is sparse unless ``i in mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``
  (then a dense MLP of ``intermediate_size``); top-k weights renormalised only with
  ``norm_topk_prob``; a shared expert of ``shared_expert_intermediate_size`` scaled by
  ``sigmoid(shared_expert_gate(x))`` added to every sparse layer; q/k/v biases with ``qkv_bias``.
- Qwen3-MoE: Qwen2-MoE's sparse-layer and renormalisation rules, no shared expert, RMSNorm over
  each query and key head before RoPE, ``attention_bias`` on all four projections.
"""

from __future__ import annotations

from typing import Any

import attrs

from modelrunner.api import check_top_k

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
"""``model_type`` → the HF ``architectures`` name of each model this adapter runs."""


@attrs.frozen
class MoeSpec:
    """The MoE-specific shape of one checkpoint."""

    architecture: str
    """HF architecture name (``MixtralForCausalLM`` …)."""
    num_experts: int
    """Routed experts per sparse layer."""
    top_k: int
    """Experts each token is routed to."""
    moe_intermediate_size: int
    """Width of each routed expert's MLP."""
    renormalize: bool
    """Whether the kept top-k weights are rescaled to sum to one."""
    shared_expert_intermediate_size: int
    """Width of the sigmoid-gated shared expert (0: none)."""
    sparse_layers: tuple[bool, ...]
    """Per decoder layer: MoE block (True) or dense MLP (False)."""
    qk_norm: bool
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections."""
    o_bias: bool = False
    """A bias on the attention's output projection."""

    @classmethod
    def from_config(cls, config: Any) -> MoeSpec:
        """Read and validate the MoE settings of a Mixtral / Qwen2-MoE / Qwen3-MoE config.

        :raises ValueError: another ``model_type``, a non-SiLU activation, ``num_experts_per_tok``
            outside ``[1, num_experts]``, or a ``decoder_sparse_step`` below 1.
        """
        model_type = getattr(config, "model_type", None)
        if model_type not in ARCHITECTURES:
            raise ValueError(f"model_type {model_type!r} is not an MoE model this adapter runs; "
                             f"supported: {', '.join(sorted(ARCHITECTURES))}")
        name = ARCHITECTURES[model_type]
        if config.hidden_act != "silu":
            raise ValueError(f"{name}: hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        layers = range(config.num_hidden_layers)
        if model_type == "mixtral":
            check_top_k(config.num_experts_per_tok, config.num_local_experts,
                        f"{name} (num_experts_per_tok vs num_local_experts)")
            bias = bool(getattr(config, "attention_bias", False))
            return cls(name, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                       renormalize=True, shared_expert_intermediate_size=0,
                       sparse_layers=tuple(True for _ in layers), qk_norm=False, qkv_bias=bias, o_bias=bias)
        step = config.decoder_sparse_step
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"{name}: decoder_sparse_step must be a positive integer, got {step!r}")
        dense = set(config.mlp_only_layers or ())
        sparse = tuple(config.num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in layers)
        if any(sparse):
            check_top_k(config.num_experts_per_tok, config.num_experts, f"{name} (num_experts_per_tok vs num_experts)")
        qwen2 = model_type == "qwen2_moe"
        if qwen2:  # q/k/v biases (never o) unless the config turns them off
            qkv_bias, o_bias = bool(getattr(config, "qkv_bias", True)), False
        else:  # Qwen3-MoE: attention_bias on all four projections
            qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
        return cls(name, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                   renormalize=bool(config.norm_topk_prob),
                   shared_expert_intermediate_size=int(config.shared_expert_intermediate_size or 0) if qwen2 else 0,
                   sparse_layers=sparse, qk_norm=not qwen2, qkv_bias=qkv_bias, o_bias=o_bias)
