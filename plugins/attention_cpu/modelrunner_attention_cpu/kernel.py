"""The C++ kernel: compiled when the plugin installs (``setup.py``, one build per instruction-set
variant), loaded on first use as the torch operator
``modelrunner_cpu::paged_decode_attention`` (callable from eager code, compiled graphs and exported
programs alike)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from modelrunner.api import NativeBuildError, load_library

VARIANTS = ("avx512", "avx2", "generic")
"""The instruction-set variants ``setup.py`` builds."""


class KernelUnavailable(NativeBuildError):
    """The C++ kernel is not available here (not built at install, or no build this CPU runs)."""


@functools.cache
def load() -> None:
    """Load the installed build of the kernel this CPU runs best into this process.

    :raises KernelUnavailable: no such build is installed; the message says how to rebuild it.
    """
    try:
        load_library(Path(__file__).parent, "paged_decode_attention", VARIANTS, "the paged-attention kernel")
    except NativeBuildError as e:
        raise KernelUnavailable(str(e)) from e
    torch.library.register_fake("modelrunner_cpu::paged_decode_attention")(_fake)


def _fake(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
          scale: float, window: int) -> torch.Tensor:
    return query.new_empty(query.shape)


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of one query per sequence over its cached keys/values, read in place.

    :param query: ``[num_seqs, num_heads, head_dim]``.
    :param kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, same dtype.
    :param block_table: ``[num_seqs, blocks]`` int32/int64, the cache blocks of each sequence in order.
    :param seq_lens: ``[num_seqs]`` positions to attend to (the query sits at ``seq_len - 1``).
    :param scale: multiplier of ``q·k``.
    :param window: attend only to the last ``window`` positions; None: all.
    :returns: ``[num_seqs, num_heads, head_dim]``.
    :raises RuntimeError: inconsistent shapes, a block id outside the cache, a ``seq_len`` the block
        table cannot hold (the message names the value).
    """
    if not torch.compiler.is_compiling():  # compiled graphs are traced after the backend loaded it
        load()
    return torch.ops.modelrunner_cpu.paged_decode_attention(query, kv_cache, block_table, seq_lens, scale, window or 0)
