"""The sparse feed-forward block of an MoE decoder layer: router, routed experts, optional shared expert."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modelrunner.api import FusedMoE, GatedMLP, ParallelState, ReplicatedLinear

from .spec import MoeSpec


class SparseMoeBlock(nn.Module):
    """``experts(x, gate(x))`` plus, for Qwen2-MoE, ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``.

    Parameter names follow the checkpoints: ``gate`` (the router, ``[experts, hidden]``),
    ``experts`` (a :class:`~modelrunner.layers.fused_moe.FusedMoE`), ``shared_expert`` (a gated
    MLP, tensor-parallel like the dense ones) and ``shared_expert_gate`` (``[1, hidden]``).

    :param spec: the architecture's MoE settings.
    :param config: the checkpoint's transformers config (model width, shared expert's activation).
    :param parallel: this rank; experts are partitioned across the tensor-parallel group.
    """

    def __init__(self, spec: MoeSpec, config: Any, parallel: ParallelState) -> None:
        super().__init__()
        hidden = config.hidden_size
        tp = {"tp_rank": parallel.tp_rank, "tp_size": parallel.tp_size, "tp_group": parallel.tp_group}
        self.gate = ReplicatedLinear(hidden, spec.num_experts)
        self.experts = FusedMoE(spec.num_experts, spec.top_k, hidden, spec.moe_intermediate_size, spec.renormalize,
                                **tp)
        self.has_shared_expert = spec.shared_expert_intermediate_size > 0
        """Whether a gated shared expert is added to the routed experts' output."""
        if self.has_shared_expert:
            self.shared_expert = GatedMLP(config, parallel, intermediate_size=spec.shared_expert_intermediate_size,
                                          bias=False)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1)
        self.router_logits: torch.Tensor | None = None
        """``[tokens, num_experts]`` router logits of the last forward."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[tokens, hidden]`` → ``[tokens, hidden]``; keeps the router logits in :attr:`router_logits`."""
        router_logits = self.gate(hidden)
        self.router_logits = router_logits
        out = self.experts(hidden, router_logits)
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out
