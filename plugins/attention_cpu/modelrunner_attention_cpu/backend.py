"""``cpu_paged``: the kernel's SDPA backend, with decode attention done by the C++ kernel."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from modelrunner.api import Attention, GraphInputs, SDPAMetadata, TorchSDPABackend

from . import kernel


class CPUPagedAttentionBackend(TorchSDPABackend):
    """Paged attention for CPUs: decode steps (and the decode part of mixed steps, speculative
    verifications included as one row per token) read the cache in place through the block table in
    one C++ pass; prompts keep torch's SDPA. Traced, the kernel
    runs where it measured faster than torch_sdpa's compiled path (see
    :func:`_traced_reductions_are_faster`)."""

    name = "cpu_paged"
    priority = 10
    max_block_size = 256  # the kernel keeps one block's row pointers on the stack
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    # Speculative verifications (1 + k tokens) as decode rows: the kernel reads a sequence's cache once per
    # row, which for a few rows costs less than the padded SDPA path, and the step can replay a decode graph.
    decode_rows_up_to = 16

    def __init__(self) -> None:
        kernel.load()  # raises KernelUnavailable with the compiler's message

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        """CPU only, and only where the kernel builds (without a compiler ``torch_sdpa`` is chosen)."""
        return torch.device(device).type == "cpu" and _kernel_builds()

    def graph_inputs(self, metadata: object) -> GraphInputs | None:
        """Decode-only steps replay: their keys/values are stored at ``slot_mapping`` and attention
        reads only ``block_table`` and ``seq_lens`` (and each layer's own settings)."""
        if type(metadata) is not SDPAMetadata or not metadata.decode_only:
            return None
        def rebuild(slots: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor) -> SDPAMetadata:
            return dataclasses.replace(metadata, slot_mapping=slots, block_table=table, seq_lens=lengths)
        return GraphInputs(("cpu_paged decode", metadata.num_seqs),
                           (metadata.slot_mapping, metadata.block_table, metadata.seq_lens), rebuild)

    def attend(self, layer: Attention, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
               kv_cache: torch.Tensor, metadata: SDPAMetadata) -> torch.Tensor:
        if not metadata.decode_only or _traced_reductions_are_faster(query.shape[0]):
            return super().attend(layer, query, key, value, kv_cache, metadata)
        out = kernel.paged_decode_attention(query, kv_cache, metadata.block_table, metadata.seq_lens, layer.scale,
                                            layer.sliding_window)
        return out.view(query.shape[0], layer.num_heads * layer.head_dim)


def _traced_reductions_are_faster(num_seqs: int | torch.SymInt) -> bool:
    """Where torch_sdpa's compiled decode attention (reductions that inductor fuses with the cache
    gather) beat calling the kernel, measured on SmolLM2 (``bench/compile.py``, numbers in the
    plugin's README): in exported programs, whose AOTInductor wrapper calls custom operators through
    its slower proxy executor, and in compiled graphs of exactly one sequence."""
    if not torch.compiler.is_compiling():
        return False
    return torch.compiler.is_exporting() or (isinstance(num_seqs, int) and num_seqs == 1)


@functools.cache
def _kernel_builds() -> bool:
    try:
        kernel.load()
    except kernel.KernelUnavailable as e:
        warnings.warn(f"attention backend 'cpu_paged' is unavailable, torch_sdpa is used instead: {e}",
                      stacklevel=3)
        return False
    return True
