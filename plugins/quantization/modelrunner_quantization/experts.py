"""Quantized experts: a :class:`~modelrunner.layers.fused_moe.FusedMoE`'s ``w13``/``w2`` stacks in planar storage.

Each stack ``[experts, rows, cols]`` becomes ``<name>`` (the quantized values), ``<name>_scales`` and
``<name>_mins``, stacked the same way, so the layer's weight loaders fill them expert by expert (or
from a fused 3-D checkpoint tensor) exactly as they fill float stacks, and expert parallelism keeps
whole experts per rank. Each expert's matrix then runs through the same kernels as a quantized
linear layer (one kernel choice per stack shape, one kernel state per expert).
"""

from __future__ import annotations

import torch
from torch import nn

from .planar import PlanarScheme

STACKS = ("w13_weight", "w2_weight")
"""The FusedMoE parameters that are quantized."""


class ExpertView:
    """One expert's matrix of a quantized stack, presented as a quantized linear layer's storage."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 logical: tuple[int, int]) -> None:
        self.weight = qweight
        """The expert's quantized values (a view of the stack)."""
        self.weight.logical_shape = logical
        self.weight_scales = scales
        """Its scales."""
        self.weight_mins = mins
        """Its minimums (None: symmetric)."""


class QuantizedExperts:
    """How a FusedMoE's experts are stored and multiplied, given the scheme a linear layer would get.

    :param template: the planar format (and kernel selector) of every expert matrix.
    """

    def __init__(self, template: PlanarScheme) -> None:
        self.template = template
        """The format each expert matrix has."""
        self.schemes: dict[str, PlanarScheme] = {}
        """Stack name → the scheme of its expert matrices (a stack's group size is its own)."""
        self.views: dict[str, list[ExpertView]] = {}
        """Stack name → one storage view per local expert."""

    def create_storage(self, moe: nn.Module) -> None:
        """Replace the layer's float stacks (on the meta device) by planar ones."""
        for name in STACKS:
            experts, rows, cols = getattr(moe, name).shape
            scheme = self.template.clone()
            scheme.create_storage(moe, rows, cols, prefix=name, experts=experts)
            self.schemes[name] = scheme
        moe.quant_scheme = self

    def process_after_loading(self, moe: nn.Module) -> None:
        """Build the per-expert views and choose each stack's kernels (once per shape)."""
        for name in STACKS:
            scheme = self.schemes[name]
            qweight, scales, mins = (getattr(moe, name), getattr(moe, f"{name}_scales"),
                                     getattr(moe, f"{name}_mins"))
            logical = tuple(qweight.logical_shape[1:])
            self.views[name] = [ExpertView(qweight[e], scales[e], None if mins is None else mins[e], logical)
                                for e in range(qweight.shape[0])]
            scheme.kernels.prepare(scheme, self.views[name][0])

    def matmul(self, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ`` for local expert ``expert`` of stack ``name``."""
        return self.schemes[name].apply(self.views[name][expert], x, None)

    def dequantized(self, moe: nn.Module, name: str) -> torch.Tensor:
        """The whole float stack ``name`` (tests)."""
        scheme = self.schemes[name]
        return torch.stack([scheme.dequantized(v) for v in self.views[name]])

    def __repr__(self) -> str:
        return f"experts {self.template!r}"


__all__ = ["STACKS", "ExpertView", "QuantizedExperts"]
