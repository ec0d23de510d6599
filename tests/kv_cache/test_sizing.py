"""Sizing the KV cache from a budget, allocating it once, and copying blocks."""

from __future__ import annotations

import pytest
import torch

from modelrunner.config import CacheConfig
from modelrunner.kv_cache import (
    KVCacheBudgetError,
    KVCacheSpec,
    allocate_kv_caches,
    copy_blocks,
    kv_cache_budget,
    num_blocks_for_budget,
)

SMOLLM2 = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32, block_size=16)
MiB = 2**20
GiB = 2**30


def test_spec_sizes() -> None:
    assert SMOLLM2.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert SMOLLM2.bytes_per_block == 737_280


def test_blocks_for_budget() -> None:
    assert num_blocks_for_budget(SMOLLM2, 256 * MiB, 2048) == 256 * MiB // 737_280 == 364
    exact = 128 * SMOLLM2.bytes_per_block  # one sequence of 2048 tokens, not a byte more
    assert num_blocks_for_budget(SMOLLM2, exact, 2048) == 128


@pytest.mark.parametrize("budget", [128 * 737_280 - 1, 0, -5])
def test_budget_too_small_says_what_is_needed(budget: int) -> None:
    with pytest.raises(KVCacheBudgetError) as excinfo:
        num_blocks_for_budget(SMOLLM2, budget, 2048)
    message = str(excinfo.value)
    assert f"{budget:,} bytes" in message
    assert "max_model_len=2048 needs 128 blocks = 94,371,840 bytes" in message
    assert "kv_cache_memory" in message
    assert isinstance(excinfo.value, ValueError)


def test_budget_rejects_bad_max_model_len() -> None:
    with pytest.raises(KVCacheBudgetError, match="max_model_len must be a positive integer, got 0"):
        num_blocks_for_budget(SMOLLM2, GiB, 0)


def test_cpu_budget() -> None:
    assert kv_cache_budget(CacheConfig(), "cpu", 10**9, 10**8) == 2 * GiB
    assert kv_cache_budget(CacheConfig(kv_cache_memory=123 * MiB), torch.device("cpu"), 0, 0) == 123 * MiB


class _FakeCUDA:
    """A GPU of 80 GiB with 70 GiB free, for the budget arithmetic on machines without one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, free: int = 70 * GiB) -> None:
        props = type("Props", (), {"total_memory": 80 * GiB})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GiB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GiB)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GiB)


def test_cuda_budget_is_utilization_minus_weights_and_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCUDA(monkeypatch)
    config = CacheConfig(gpu_memory_utilization=0.5)
    assert kv_cache_budget(config, "cuda:0", 10 * GiB, 2 * GiB) == 40 * GiB - 12 * GiB
    assert kv_cache_budget(CacheConfig(kv_cache_memory=GiB), "cuda", 10 * GiB, 2 * GiB) == GiB


def test_cuda_budget_is_capped_by_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCUDA(monkeypatch, free=5 * GiB)  # another process holds most of the device
    assert kv_cache_budget(CacheConfig(gpu_memory_utilization=0.9), "cuda", GiB, GiB) == 5 * GiB + 2 * GiB


def test_cuda_budget_exhausted(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCUDA(monkeypatch)
    with pytest.raises(KVCacheBudgetError, match="Raise gpu_memory_utilization or set kv_cache_memory"):
        kv_cache_budget(CacheConfig(gpu_memory_utilization=0.1), "cuda", 7 * GiB, 2 * GiB)


def _spec() -> KVCacheSpec:
    return KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=4)


def test_one_allocation_viewed_per_layer() -> None:
    caches = allocate_kv_caches(_spec(), 10, "cpu")
    assert len(caches) == 3
    base = caches[0].untyped_storage().data_ptr()
    for layer in caches:
        assert layer.shape == (2, 10, 4, 2, 4) and layer.dtype == torch.float32
        assert layer.untyped_storage().data_ptr() == base and not layer.any()
    caches[1].fill_(1.0)
    assert not caches[0].any() and not caches[2].any()


def test_copy_blocks_copies_k_and_v_of_every_layer() -> None:
    caches = allocate_kv_caches(_spec(), 6, "cpu")
    for i, layer in enumerate(caches):
        layer.copy_(torch.randn_like(layer) + i)
    before = [layer.clone() for layer in caches]
    copy_blocks(caches, [(1, 4), (2, 5)])
    for layer, old in zip(caches, before):
        assert torch.equal(layer[:, 4], old[:, 1]) and torch.equal(layer[:, 5], old[:, 2])
        assert torch.equal(layer[:, :4], old[:, :4])
    after = [layer.clone() for layer in caches]
    copy_blocks(caches, [])
    assert all(torch.equal(layer, old) for layer, old in zip(caches, after))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocation_and_copies() -> None:
    budget = kv_cache_budget(CacheConfig(gpu_memory_utilization=0.5), "cuda", 0, 0)
    assert 0 < budget <= torch.cuda.get_device_properties(0).total_memory
    caches = allocate_kv_caches(_spec(), 6, "cuda")
    caches[0][:, 1] = 3.0
    copy_blocks(caches, [(1, 2)])
    assert caches[0][:, 2].eq(3.0).all() and caches[0].device.type == "cuda"
