"""Qwen3's attention: the decoder attention with RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modelrunner.api import AttentionBackend, DecoderAttention, ParallelState, RMSNorm, RotaryEmbedding


class QKNormRotary(nn.Module):
    """RoPE preceded by per-head RMSNorm: stands in for the Llama attention's ``rotary_emb``.

    The decoder attention rotates its query and key heads together (``rotate(positions, qk)`` with
    ``qk`` ``[tokens, heads + kv_heads, head_dim]``); normalising them first there is exactly
    where Qwen3 puts ``q_norm`` / ``k_norm``, so the attention's own code runs unchanged.

    :param rotary: the rotary embedding to apply after the norms.
    :param num_heads: query heads on this rank (the first ``num_heads`` rows of ``qk``).
    :param q_norm: RMSNorm of a query head; ``k_norm`` likewise for a key head. Both stay owned
        by the attention layer (that is where checkpoints name them), so they are not registered here.
    """

    def __init__(self, rotary: RotaryEmbedding, num_heads: int, q_norm: RMSNorm, k_norm: RMSNorm) -> None:
        super().__init__()
        self.rotary = rotary
        self.num_heads = num_heads
        """Query heads on this rank."""
        self._norms = (q_norm, k_norm)

    def rotate(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """``qk`` ``[tokens, heads + kv_heads, head_dim]`` normalised per head, then rotated."""
        q_norm, k_norm = self._norms
        q, k = qk.split((self.num_heads, qk.shape[1] - self.num_heads), dim=1)
        return self.rotary.rotate(positions, torch.cat((q_norm(q), k_norm(k)), dim=1))


class QKNormAttention(DecoderAttention):
    """:class:`~modelrunner.models.DecoderAttention` with Qwen3's ``q_norm`` and ``k_norm``."""

    def __init__(self, config: Any, max_position: int, sliding_window: int | None, parallel: ParallelState,
                 backend: AttentionBackend, qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__(config, max_position, sliding_window, parallel, backend, qkv_bias, o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = QKNormRotary(self.rotary_emb, self.num_heads, self.q_norm, self.k_norm)
