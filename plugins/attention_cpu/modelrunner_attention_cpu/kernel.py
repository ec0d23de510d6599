"""The C++ kernel: built once per machine on first use, then loaded as the torch operator
``modelrunner_cpu::paged_decode_attention`` (callable from eager code, compiled graphs and exported
programs alike)."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_decode_attention.cpp")
"""The kernel's source, shipped with the package."""

# -march=native: the library is built on the machine that runs it (and rebuilt if the flags change).
# -ffp-contract=fast: multiply-adds fused (the -std=c++17 that torch passes turns that off).
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast", *(["-march=native"] if platform.machine() in ("x86_64", "AMD64") else [])]


class KernelUnavailable(RuntimeError):
    """The C++ kernel could not be built or loaded here (no compiler, no ninja, unsupported platform)."""


@functools.cache
def load() -> None:
    """Build the kernel if this machine has no build of this exact source, flags and torch yet
    (torch.utils.cpp_extension, under ``$TORCH_EXTENSIONS_DIR``), and load it into this process.

    :raises KernelUnavailable: the build failed; the message carries the compiler's complaint.
    """
    from torch.utils import cpp_extension

    key = SOURCE.read_bytes() + " ".join(CFLAGS).encode() + torch.__version__.encode()
    name = f"modelrunner_attention_cpu_{hashlib.sha256(key).hexdigest()[:12]}"
    _put_ninja_on_path()
    try:
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 (any build failure means: not available here)
        raise KernelUnavailable(f"could not build the paged-attention kernel {SOURCE}: {type(e).__name__}: {e}") from e
    torch.library.register_fake("modelrunner_cpu::paged_decode_attention")(_fake)


def _fake(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
          scale: float, window: int) -> torch.Tensor:
    return query.new_empty(query.shape)


def _put_ninja_on_path() -> None:
    # cpp_extension runs `ninja` from PATH; the pip package's binary is not there unless its venv is activated.
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


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
