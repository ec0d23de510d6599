"""Mixtral, Qwen2-MoE and Qwen3-MoE as the kernel's shared decoder with MoE blocks in place of (some) MLPs.

:class:`~modelrunner.models.DecoderForCausalLM` supplies everything the families share — embedding,
paged attention with RoPE, pre-norm residual layers, final norm, LM head, tensor-parallel sharding
and the forward loop. :class:`MoeForCausalLM` overrides its factories: per layer, a
:class:`~.moe_block.SparseMoeBlock` instead of the gated MLP where the architecture makes the layer
sparse, and, for Qwen3, :class:`~.attention.QKNormAttention`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modelrunner.api import AttentionBackend, DecoderForCausalLM, FusedMoE, ParallelState

from .attention import QKNormAttention
from .moe_block import SparseMoeBlock
from .spec import MoeSpec


class MoeForCausalLM(DecoderForCausalLM):
    """A Mixtral / Qwen2-MoE / Qwen3-MoE causal LM over a flattened, paged batch.

    :param config: the checkpoint's transformers config.
    :param max_position: longest sequence the model will see (size of the RoPE table).
    :param parallel: this process's tensor-parallel rank (experts are partitioned across ranks) and
        pipeline stage (only its layers are built; the others are placeholders).
    :param attn_backend: the attention implementation.
    :raises ValueError: see :meth:`MoeSpec.from_config`.
    """

    def __init__(self, config: Any, max_position: int, parallel: ParallelState | None = None,
                 attn_backend: AttentionBackend | None = None) -> None:
        self.spec = MoeSpec.from_config(config)  # the factories below read it while the layers are built
        super().__init__(config, max_position, parallel, attn_backend)
        self.packed_modules_mapping = {**DecoderForCausalLM.packed_modules_mapping,
                                       **FusedMoE.packed_modules_mapping(self.spec.num_experts)}
        """Fused parameter → the checkpoint projections packed into it (attention, dense MLPs, experts)."""
        self.return_router_logits = bool(getattr(config, "output_router_logits", False))
        """Return router logits from every step, not only those that ask (the config's ``output_router_logits``)."""

    def attention_biases(self, config: Any) -> tuple[bool, bool]:
        """The architecture's biases (see :class:`MoeSpec`)."""
        return self.spec.qkv_bias, self.spec.o_bias

    def make_attention(self, config: Any, layer: int, max_position: int, sliding_window: int | None) -> nn.Module:
        """Qwen3's q/k-normed attention, else the decoder's."""
        if not self.spec.qk_norm:
            return super().make_attention(config, layer, max_position, sliding_window)
        return QKNormAttention(config, max_position, sliding_window, self.parallel, self.attn_backend,
                               self.spec.qkv_bias, self.spec.o_bias)

    def make_mlp(self, config: Any, layer: int) -> nn.Module:
        """A sparse MoE block where the architecture makes layer ``layer`` sparse, else the gated MLP."""
        if self.spec.sparse_layers[layer]:
            return SparseMoeBlock(self.spec, config, self.parallel)
        return super().make_mlp(config, layer)

    @property
    def moe_layers(self) -> list[tuple[int, SparseMoeBlock]]:
        """``(layer index, block)`` of every sparse layer on this pipeline stage, in order."""
        layers = self.model.layers
        return [(i, layers[i].mlp) for i in range(self.model.start_layer, self.model.end_layer)
                if isinstance(layers[i].mlp, SparseMoeBlock)]

    def router_logits(self) -> list[torch.Tensor]:
        """The last forward's router logits: one ``[num_tokens, num_experts]`` tensor per sparse layer."""
        return [block.router_logits for _, block in self.moe_layers]

    def runner_stats(self) -> dict[str, Any]:
        """Expert load, for :meth:`modelrunner.runner.ModelRunner.stats` (under ``"model"``).

        ``expert_token_counts[l][e]`` counts the tokens sparse layer ``moe_layers[l]`` routed to
        expert ``e`` since loading (a token counts once for each of its ``top_k`` experts);
        ``last_step_expert_token_counts`` is the same for the last step only.
        """
        blocks = self.moe_layers
        return {
            "architecture": self.spec.architecture,
            "num_experts": self.spec.num_experts,
            "top_k": self.spec.top_k,
            "moe_layers": [i for i, _ in blocks],
            "expert_token_counts": [block.experts.expert_token_counts.tolist() for _, block in blocks],
            "last_step_expert_token_counts": [list(block.experts.last_expert_token_counts) for _, block in blocks],
        }
