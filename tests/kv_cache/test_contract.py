"""The allocator contract, run against every allocator the installed plugins provide."""

from __future__ import annotations

import importlib.util

import pytest

from modelrunner.config import CacheConfig
from modelrunner.kv_cache.testing import AllocatorContract
from modelrunner.plugins import create_allocator, get_registry

ALLOCATORS = get_registry().names("allocators")


class TestInstalledAllocator(AllocatorContract):
    """One run of the whole contract per installed allocator (``[paged]``, ``[contiguous]``, ...)."""

    @pytest.fixture(autouse=True, params=ALLOCATORS)
    def allocator_name(self, request: pytest.FixtureRequest) -> str:
        self.name = request.param
        probe = self.make_allocator(8, 4, 16, True)
        # What the allocator declares it can do decides which rules apply (BlockAllocator's docstring).
        self.supports_prefix_caching = probe.supports_prefix_caching
        self.shares_blocks_on_fork = probe.shares_blocks_on_fork
        return self.name

    def make_allocator(self, num_blocks, block_size, max_model_len, enable_prefix_caching=True):
        config = CacheConfig(block_size=block_size, kv_allocator=self.name, enable_prefix_caching=enable_prefix_caching)
        allocator = create_allocator(self.name, num_blocks, block_size, max_model_len, config)
        assert (allocator.num_blocks, allocator.block_size, allocator.max_model_len) == (
            num_blocks, block_size, max_model_len
        )
        return allocator


def test_kernel_and_installed_allocators_are_discovered() -> None:
    assert "paged" in ALLOCATORS
    if importlib.util.find_spec("modelrunner_kv_contiguous") is not None:
        assert "contiguous" in ALLOCATORS


def test_unknown_allocator_names_the_installed_ones() -> None:
    with pytest.raises(ValueError, match="paged") as excinfo:
        create_allocator("pagd", 8, 4, 16, CacheConfig())
    assert "'pagd'" in str(excinfo.value)
