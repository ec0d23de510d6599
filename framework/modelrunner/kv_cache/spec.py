"""What a model's KV cache looks like: enough to size it and lay it out."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class KVCacheSpec:
    """The KV cache of one group of attention layers that share a shape."""

    num_layers: int
    """Attention layers in the group (each gets its own K and V)."""
    num_kv_heads: int
    """Key/value heads per layer held by this process (after tensor-parallel splitting)."""
    head_dim: int
    """Size of one head."""
    dtype: torch.dtype
    """Element type of the cache."""
    block_size: int = 16
    """Token slots per block."""

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) · layers · kv heads · head dim · dtype size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across every layer of the group."""
        return self.bytes_per_token * self.block_size

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor: ``[2, num_blocks, block_size, kv_heads, head_dim]``."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
