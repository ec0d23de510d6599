"""Rotary position embedding (RoPE), with the frequency scalings Llama-family checkpoints use.

The cos/sin table is computed once for every position up to ``max_position`` and indexed by each
token's position, so a flattened batch of sequences at different positions costs one gather.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3")
"""The ``rope_type`` values :class:`RotaryEmbedding` implements."""


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of a transformers config as one dict with ``rope_type`` and ``rope_theta``.

    Reads transformers 5.x ``config.rope_parameters`` and falls back to the legacy ``rope_theta`` /
    ``rope_scaling`` attributes (``type`` is accepted for ``rope_type``).
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Per-pair rotation frequencies ``[head_dim // 2]`` (float32) for the given RoPE settings.

    :raises ValueError: for a ``rope_type`` not in :data:`ROPE_TYPES`.
    """
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    # On the CPU whatever the ambient device: under ``torch.device("meta")`` (model construction) these
    # ops would go through torch's Python reference implementations, whose import costs a second.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
"""Shared cos/sin tables, alive while some module holds them."""


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by their token's position (the "neox" half-split layout of transformers).

    :param head_dim: size of each head (the whole head is rotated).
    :param max_position: positions the cos/sin table covers.
    :param params: RoPE settings as returned by :func:`rope_parameters`.
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        """Size of each rotated head."""
        self.max_position = max_position
        """Positions covered by the table."""
        self.params = dict(params or {"rope_type": "default", "rope_theta": 10000.0})
        """RoPE settings (``rope_type``, ``rope_theta`` and the scaling's own keys)."""
        inverse_frequencies(head_dim, self.params)  # fail at construction on unsupported settings
        self.register_buffer("cos_sin_cache", torch.empty(max_position, head_dim), persistent=False)
        if self.cos_sin_cache.device.type != "meta":
            self.reset_buffers()

    @classmethod
    def from_config(cls, config: Any, head_dim: int, max_position: int) -> RotaryEmbedding:
        """Build from a transformers config (``rope_parameters`` or legacy ``rope_theta``/``rope_scaling``)."""
        return cls(head_dim, max_position, rope_parameters(config))

    def reset_buffers(self) -> None:
        """(Re)compute the cos/sin table: ``[max_position, head_dim]``, cos half then sin half.

        Every rotary embedding with the same settings on the same device shares one table (a model's
        layers all have the same one: one copy, not one per layer)."""
        cache = self.cos_sin_cache
        key = (self.head_dim, self.max_position, repr(sorted(self.params.items())), str(cache.device), cache.dtype)
        table = _TABLES.get(key)
        if table is None:
            inv_freq = inverse_frequencies(self.head_dim, self.params).to(cache.device)
            freqs = torch.arange(self.max_position, device=cache.device, dtype=torch.float32)[:, None] * inv_freq
            table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(cache.dtype)
            _TABLES[key] = table
        self.cos_sin_cache = table

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[tokens, heads, head_dim]`` rotated by ``positions`` ``[tokens]`` (a new tensor)."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(-2).chunk(2, dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` ``[tokens, heads, head_dim]`` and ``key`` ``[tokens, kv_heads, head_dim]``."""
        return self.rotate(positions, query), self.rotate(positions, key)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}, {self.params}"
