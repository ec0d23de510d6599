"""RMSNorm, optionally fused with the residual add that precedes it in pre-norm transformers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import default_weight_loader


class RMSNorm(nn.Module):
    """Root-mean-square layer norm: ``weight * x / sqrt(mean(x²) + eps)``, computed in float32.

    Calling it with a ``residual`` first adds the residual and returns ``(normed, new_residual)``, the
    pattern of every pre-norm decoder layer (``residual = x + residual; x = norm(residual)``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        """Width of the normalised last dimension."""
        self.eps = eps
        """Added to the mean square before the square root."""
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        # Like transformers: normalise in float32, round to the input dtype, then scale.
        return self.weight * F.rms_norm(x.float(), (self.hidden_size,), None, self.eps).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given."""
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
