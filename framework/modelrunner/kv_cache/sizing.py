"""Sizing the KV cache from a memory budget, allocating it once, and copying blocks within it."""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from modelrunner.config import CacheConfig
from modelrunner.errors import ModelRunnerError

from .allocator import BlockCopy
from .spec import KVCacheSpec

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3
"""KV-cache bytes on CPU (and other non-CUDA devices) when ``kv_cache_memory`` is not set."""


class KVCacheBudgetError(ModelRunnerError, ValueError):
    """The memory budget cannot hold the KV cache the configuration asks for."""


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int, max_model_len: int) -> int:
    """How many blocks of ``spec`` fit in ``budget_bytes``.

    :raises KVCacheBudgetError: the budget cannot hold one sequence of ``max_model_len`` tokens.
    """
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len <= 0:
        raise KVCacheBudgetError(f"max_model_len must be a positive integer, got {max_model_len!r}")
    budget_bytes = int(budget_bytes)
    num_blocks = max(budget_bytes, 0) // spec.bytes_per_block
    blocks_per_seq = -(-max_model_len // spec.block_size)
    if num_blocks < blocks_per_seq:
        needed = blocks_per_seq * spec.bytes_per_block
        raise KVCacheBudgetError(
            f"KV-cache budget of {budget_bytes:,} bytes ({_mib(budget_bytes)}) holds {num_blocks} block(s) of "
            f"{spec.block_size} tokens ({spec.bytes_per_block:,} bytes each), but one sequence of "
            f"max_model_len={max_model_len} needs {blocks_per_seq} blocks = {needed:,} bytes ({_mib(needed)}). "
            f"Raise kv_cache_memory (or gpu_memory_utilization on GPU) or lower max_model_len."
        )
    return num_blocks


def kv_cache_budget(
    cache_config: CacheConfig, device: torch.device | str, weights_bytes: int, activation_peak_bytes: int
) -> int:
    """Bytes the KV cache may take on ``device``.

    ``kv_cache_memory`` when set. Otherwise, on CUDA, what ``gpu_memory_utilization`` of the device
    leaves after the weights and the activation peak (and no more than the device reports free now);
    elsewhere :data:`DEFAULT_CPU_KV_CACHE_MEMORY`.

    :raises KVCacheBudgetError: on CUDA, nothing is left for the cache.
    """
    if cache_config.kv_cache_memory is not None:
        return cache_config.kv_cache_memory
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_MEMORY
    total = torch.cuda.get_device_properties(device).total_memory
    free_now, _ = torch.cuda.mem_get_info(device)
    # Memory torch's caching allocator holds but no tensor uses is ours too.
    free_now += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    allowed = int(cache_config.gpu_memory_utilization * total)
    budget = min(allowed - weights_bytes - activation_peak_bytes, free_now)
    if budget <= 0:
        raise KVCacheBudgetError(
            f"no GPU memory left for the KV cache on {device}: gpu_memory_utilization="
            f"{cache_config.gpu_memory_utilization} of {_mib(total)} allows {_mib(allowed)}, the weights take "
            f"{_mib(weights_bytes)} and the activation peak {_mib(activation_peak_bytes)} "
            f"({_mib(free_now)} free on the device now). Raise gpu_memory_utilization or set kv_cache_memory."
        )
    return budget


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
    """The whole KV cache as one zeroed tensor, returned as one view per layer.

    Each view is ``[2, num_blocks, block_size, kv_heads, head_dim]`` (``spec.layer_shape``); the
    tensor is allocated once here and never grown. On the CPU it is an anonymous memory map: its
    pages are zero and become resident only as blocks are written, so a large budget costs address
    space, not memory, until the run uses it.
    """
    shape = (spec.num_layers, *spec.layer_shape(num_blocks))
    device = torch.device(device)
    nbytes = math.prod(shape) * spec.dtype.itemsize
    if device.type == "cpu" and nbytes > 0:
        pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        cache = torch.frombuffer(pages, dtype=spec.dtype).view(shape)
    else:
        cache = torch.zeros(shape, dtype=spec.dtype, device=device)
    return list(cache.unbind(0))


def copy_blocks(kv_caches: Sequence[torch.Tensor], copies: Sequence[BlockCopy]) -> None:
    """Copy whole blocks (K and V, every layer): ``dst`` receives ``src`` for each ``(src, dst)``."""
    if not copies or not kv_caches:
        return
    device = kv_caches[0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
    for layer in kv_caches:
        layer.index_copy_(1, dst, layer.index_select(1, src))
