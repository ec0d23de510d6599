"""The contiguous allocator plugin: a static reservation per sequence (the paged allocator's baseline)."""

from __future__ import annotations

import pytest

from modelrunner.config import CacheConfig
from modelrunner_kit.allocator_contract import assert_rejected, check_consistency
from modelrunner.plugins import create_allocator, get_plugins

contiguous = pytest.importorskip("modelrunner_kv_contiguous")


def make(num_blocks: int = 20, block_size: int = 4, max_model_len: int = 16):
    return create_allocator("contiguous", num_blocks, block_size, max_model_len, CacheConfig(block_size=block_size))


def test_each_sequence_reserves_max_model_len() -> None:
    a = make()
    assert isinstance(a, contiguous.ContiguousBlockAllocator)
    assert a.allocate(1, [1]) == 0
    assert a.block_table(1) == [0, 1, 2, 3]
    s = a.stats()
    assert (s.used_blocks, s.reserved_slots, s.used_slots) == (4, 16, 1)
    assert s.fragmentation == pytest.approx(15 / 16)


def test_pool_holds_whole_reservations_only() -> None:
    a = make(num_blocks=22)  # 5 reservations of 4 blocks; 2 blocks can never be used
    for seq_id in range(5):
        a.allocate(seq_id, [seq_id])
    assert not a.can_allocate([9])
    message = assert_rejected(a, range(5), lambda: a.allocate(9, [9]), 9)
    assert "all 5 reservations of the 22-block pool are in use" in message
    assert a.stats().free_blocks == 2
    a.free(2)
    a.allocate(9, [9])
    assert a.block_table(9) == [8, 9, 10, 11]  # the lowest free reservation


def test_no_prefix_caching_even_when_asked() -> None:
    a = create_allocator("contiguous", 20, 4, 16, CacheConfig(enable_prefix_caching=True))
    assert a.enable_prefix_caching is False
    a.allocate(1, list(range(9)))
    a.free(1)
    assert a.allocate(2, list(range(9))) == 0
    s = a.stats()
    assert (s.prefix_queries, s.prefix_hits, s.cached_free_blocks) == (18, 0, 0)


def test_fork_copies_used_blocks_into_a_new_reservation() -> None:
    a = make(num_blocks=8)
    a.allocate(1, list(range(6)))
    assert a.fork(1, 2) == [(0, 4), (1, 5)]
    assert a.block_table(2) == [4, 5, 6, 7] and a.num_tokens(2) == 6
    check_consistency(a, {1: list(range(6)), 2: list(range(6))})
    assert_rejected(a, [1, 2], lambda: a.fork(1, 3), 3)


def test_plugin_is_listed_with_its_distribution() -> None:
    info = next(i for i in get_plugins().list() if i.name == "contiguous")
    assert info.distribution == "modelrunner-kv-contiguous" and info.error is None
    assert info.provides == {"allocators": ["contiguous"]}
    assert {"allocate", "register"} <= set(info.hooks)
