"""``cpu_paged``: the kernel's SDPA backend, with decode attention done by the C++ kernel."""

from __future__ import annotations

import functools
import warnings

import torch
from modelrunner.layers import Attention
from modelrunner.layers.sdpa_attention import SDPAMetadata, TorchSDPABackend

from . import kernel


class CPUPagedAttentionBackend(TorchSDPABackend):
    """Paged attention for CPUs: decode steps (and the decode part of mixed steps) read the cache in
    place through the block table in one C++ pass, eager or compiled; prompts keep torch's SDPA."""

    name = "cpu_paged"
    priority = 10

    def __init__(self) -> None:
        kernel.load()  # raises KernelUnavailable with the compiler's message

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        """CPU only, and only where the kernel builds (without a compiler ``torch_sdpa`` is chosen)."""
        return torch.device(device).type == "cpu" and _kernel_builds()

    def attend(self, layer: Attention, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: SDPAMetadata) -> torch.Tensor:
        if not metadata.decode_only:
            return super().attend(layer, query, key, value, kv_cache, metadata)
        num_tokens = query.shape[0]
        out = kernel.paged_decode_attention(query.view(num_tokens, layer.num_heads, layer.head_dim), kv_cache,
                                            metadata.block_table, metadata.seq_lens, layer.scale,
                                            layer.sliding_window)
        return out.view(num_tokens, layer.num_heads * layer.head_dim)


@functools.cache
def _kernel_builds() -> bool:
    try:
        kernel.load()
    except kernel.KernelUnavailable as e:
        warnings.warn(f"attention backend 'cpu_paged' is unavailable, torch_sdpa is used instead: {e}",
                      stacklevel=3)
        return False
    return True
