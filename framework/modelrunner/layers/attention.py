"""The attention core of a layer: cache write, paged read, softmax(QKᵀ)V, through an attention backend.

The implementation is an :class:`~.attention_backend.AttentionBackend` chosen once per model by the
runner; the kernel's ``torch_sdpa`` (:mod:`.sdpa_attention`) runs everywhere torch does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention_backend import AttentionBackend
from .sdpa_attention import TorchSDPABackend

__all__ = ["Attention", "AttentionBackend"]


class Attention(nn.Module):
    """The attention core of one layer: cache write, paged read, softmax(QKᵀ)V. No projections.

    :param num_heads: query heads on this rank.
    :param head_dim: size of each head.
    :param scale: multiplier of ``QKᵀ`` (usually ``head_dim ** -0.5``).
    :param num_kv_heads: key/value heads on this rank (fewer than ``num_heads`` for GQA).
    :param sliding_window: attend only to the last ``sliding_window`` positions (Mistral); None: all.
    :param backend: the implementation (the one the load hook received); default: ``torch_sdpa``.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        """Query heads on this rank."""
        self.num_kv_heads = num_kv_heads
        """Key/value heads on this rank."""
        self.head_dim = head_dim
        """Size of each head."""
        self.scale = scale
        """Multiplier of the attention scores."""
        self.sliding_window = sliding_window
        """Window of visible past positions, or None for full causal attention."""
        self.backend = backend or TorchSDPABackend()
        """The attention implementation."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`."""
        return self.backend.forward(self, query, key, value, kv_cache, metadata)

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{window}, "
                f"backend={self.backend.name}")
