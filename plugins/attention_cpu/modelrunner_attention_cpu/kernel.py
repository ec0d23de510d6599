"""The C++ kernel: built once per machine on first use, then loaded as the torch operator
``modelrunner_cpu::paged_decode_attention`` (callable from eager code, compiled graphs and exported
programs alike)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from modelrunner.native import NativeBuildError, build_extension, native_cflags

SOURCE = Path(__file__).with_name("paged_decode_attention.cpp")
"""The kernel's source, shipped with the package."""

CFLAGS = native_cflags()
"""Built on the machine that runs it, ``-march=native`` (rebuilt if the flags, torch or the CPU change)."""


class KernelUnavailable(NativeBuildError):
    """The C++ kernel could not be built or loaded here (no compiler, no ninja, unsupported platform)."""


@functools.cache
def load() -> None:
    """Build the kernel if this machine has no build of this exact source, flags, torch and CPU yet
    (under ``$TORCH_EXTENSIONS_DIR``), and load it into this process.

    :raises KernelUnavailable: the build failed; the message carries the compiler's complaint.
    """
    try:
        build_extension("modelrunner_attention_cpu", SOURCE, CFLAGS, "the paged-attention kernel")
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
