"""Mixtral, Qwen2-MoE and Qwen3-MoE as the Llama decoder with MoE blocks in place of (some) MLPs.

The Llama adapter's model supplies everything the families share — embedding, paged attention
with RoPE, pre-norm residual layers, final norm, LM head, tensor-parallel sharding and the
forward loop. :class:`MoeForCausalLM` builds that skeleton and then swaps, per layer, the MLP for
a :class:`~.moe_block.SparseMoeBlock` (where the architecture makes the layer sparse) and, for
Qwen3, the attention for :class:`~.attention.QKNormAttention`. Build it on the ``meta`` device
(as :func:`~.loader.build_moe_model` does) so the replaced modules never allocate memory.
"""

from __future__ import annotations

from typing import Any

import torch

from modelrunner.layers import AttentionBackend
from modelrunner.layers.fused_moe import FusedMoE
from modelrunner.parallel_state import ParallelState
from modelrunner_llama.model import LlamaForCausalLM

from .attention import QKNormAttention
from .moe_block import SparseMoeBlock
from .spec import MoeSpec


class MoeForCausalLM(LlamaForCausalLM):
    """A Mixtral / Qwen2-MoE / Qwen3-MoE causal LM over a flattened, paged batch.

    :param config: the checkpoint's transformers config.
    :param max_position: longest sequence the model will see (size of the RoPE table).
    :param parallel: this process's tensor-parallel rank (experts are partitioned across ranks) and
        pipeline stage (only its layers are built; the others are placeholders, as in the Llama model).
    :param attn_backend: the attention implementation (default: chosen for CPU).
    :raises ValueError: see :meth:`MoeSpec.from_config`.
    """

    def __init__(self, config: Any, max_position: int, parallel: ParallelState | None = None,
                 attn_backend: AttentionBackend | None = None) -> None:
        spec = MoeSpec.from_config(config)
        super().__init__(spec.attention_config(config), max_position, parallel, attn_backend)
        self.spec = spec
        """The architecture's MoE settings."""
        self.hf_config = config
        """The checkpoint's own config (``self.config`` is what the Llama layers were built from)."""
        for i in range(self.model.start_layer, self.model.end_layer):  # this pipeline stage's layers
            layer = self.model.layers[i]
            if spec.qk_norm:
                layer.self_attn = QKNormAttention(self.config, max_position, layer.self_attn.attn.sliding_window,
                                                  self.parallel, self.attn_backend)
            if spec.sparse_layers[i]:
                layer.mlp = SparseMoeBlock(spec, config, self.parallel)
        self.packed_modules_mapping = {**LlamaForCausalLM.packed_modules_mapping,
                                       **FusedMoE.packed_modules_mapping(spec.num_experts)}
        """Fused parameter → the checkpoint projections packed into it (attention, dense MLPs, experts)."""
        self.return_router_logits = bool(getattr(config, "output_router_logits", False))
        """Return router logits from every step, not only those that ask (the config's ``output_router_logits``)."""

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
