"""The kernel's default allocator plugin: provides ``paged``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelrunner.hookspecs import hookimpl

from .paged import PagedBlockAllocator

if TYPE_CHECKING:
    from modelrunner.config import CacheConfig
    from modelrunner.registry import Registry


@hookimpl
def register(registry: Registry) -> None:
    """Declare the ``paged`` allocator."""
    registry.allocators(PagedBlockAllocator.name, prefix_caching=True)


@hookimpl
def allocate(num_blocks: int, block_size: int, max_model_len: int, config: CacheConfig) -> PagedBlockAllocator:
    """A fresh :class:`PagedBlockAllocator` (the kernel calls this only for ``paged``)."""
    return PagedBlockAllocator(
        num_blocks, block_size, max_model_len, enable_prefix_caching=config.enable_prefix_caching
    )
