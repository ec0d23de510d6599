"""What the paged allocator promises beyond the contract: its eviction order, sharing, and cost."""

from __future__ import annotations

import pytest

from modelrunner.kv_cache import KVCacheError, PagedBlockAllocator
from modelrunner.kv_cache import paged
from modelrunner_kit.allocator_contract import assert_rejected, check_consistency


@pytest.mark.parametrize("field", ["num_blocks", "block_size", "max_model_len"])
@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_constructor_rejects_bad_sizes(field: str, value: object) -> None:
    sizes = {"num_blocks": 8, "block_size": 4, "max_model_len": 16, field: value}
    with pytest.raises(ValueError, match=f"{field} must be a positive integer, got {value!r}"):
        PagedBlockAllocator(**sizes)


def test_unused_blocks_are_taken_before_cached_ones_and_tails_before_heads() -> None:
    a = PagedBlockAllocator(6, 2, 32)
    a.allocate(1, [1, 2, 3, 4])  # two full blocks, both cached once freed
    head, tail = a.block_table(1)
    a.free(1)
    a.allocate(2, [50, 51, 52, 53, 54, 55, 56, 57])  # the 4 never-used blocks
    assert head not in a.block_table(2) and tail not in a.block_table(2)
    a.allocate(3, [60])  # one more: evicts the tail of seq 1, not its head
    assert a.block_table(3) == [tail]
    a.free(2)
    assert a.allocate(4, [1, 2, 3, 4]) == 2 and a.block_table(4)[0] == head


def test_least_recently_freed_prefix_is_evicted_first() -> None:
    a = PagedBlockAllocator(4, 2, 32)
    blocks = {}
    for seq_id in (1, 2, 3, 4):
        a.allocate(seq_id, [seq_id, seq_id])  # one full block each
        blocks[seq_id] = a.block_table(seq_id)[0]
    for seq_id in (3, 1, 4, 2):
        a.free(seq_id)
    assert a.stats().cached_free_blocks == 4
    a.allocate(5, [9, 10, 11, 12])  # two blocks: evicts the two prefixes freed first
    assert a.block_table(5) == [blocks[3], blocks[1]]
    assert a.stats().cached_free_blocks == 2
    a.allocate(6, [12])
    assert a.block_table(6) == [blocks[4]]


def test_blocks_filled_by_appends_are_cached() -> None:
    a = PagedBlockAllocator(16, 4, 32)
    a.allocate(1, [0, 1, 2])
    a.append_slots(1, [3])
    a.append_slots(1, [4, 5, 6, 7, 8])
    table = a.block_table(1)
    a.free(1)
    assert a.stats().cached_free_blocks == 2
    assert a.allocate(2, list(range(9)) + [42]) == 8 and a.block_table(2)[:2] == table[:2]


def test_a_block_computed_twice_is_cached_once() -> None:
    a = PagedBlockAllocator(16, 4, 32)
    a.allocate(1, list(range(8)))
    assert a.allocate(2, list(range(8))) == 4  # its second block is recomputed into a new block
    first, second = a.block_table(1), a.block_table(2)
    assert first[0] == second[0] and first[1] != second[1]
    a.free(2)
    a.free(1)
    assert a.stats().cached_free_blocks == 2
    assert a.allocate(3, list(range(8)) + [8]) == 8 and a.block_table(3)[:2] == first


def test_live_prefix_is_shared_by_reference() -> None:
    a = PagedBlockAllocator(16, 4, 32)
    a.allocate(1, list(range(10)))
    used = a.stats().used_blocks
    assert a.allocate(2, list(range(8)) + [99, 98]) == 8
    t1, t2 = a.block_table(1), a.block_table(2)
    assert t1[:2] == t2[:2] and t1[2] != t2[2]
    assert [a.ref_count(b) for b in t2] == [2, 2, 1]
    assert a.stats().used_blocks == used + 1
    check_consistency(a, {1: list(range(10)), 2: list(range(8)) + [99, 98]})
    a.free(1)
    assert [a.ref_count(b) for b in t2] == [1, 1, 1] and a.ref_count(t1[2]) == 0


def test_fork_with_a_full_last_block_needs_no_copy() -> None:
    a = PagedBlockAllocator(16, 4, 32)
    a.allocate(1, list(range(8)))
    a.fork(1, 2)
    assert a.append_slots(2, [8]) == [] and a.append_slots(1, [9]) == []
    assert a.block_table(1)[:2] == a.block_table(2)[:2] and a.block_table(1)[2] != a.block_table(2)[2]


def test_decode_hashes_only_when_a_block_fills(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_chain = paged._chain
    monkeypatch.setattr(paged, "_chain", lambda *args: calls.append(args) or real_chain(*args))
    a = PagedBlockAllocator(8, 16, 64)
    a.allocate(1, [7])
    for i in range(14):
        a.append_slots(1, [i])
    assert calls == []
    a.append_slots(1, [14])  # the 16th token fills the block
    assert len(calls) == 1


def test_decode_hashes_nothing_without_prefix_caching(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(paged, "_chain", lambda *args: calls.append(args))
    a = PagedBlockAllocator(8, 4, 64, enable_prefix_caching=False)
    a.allocate(1, list(range(9)))
    for i in range(20):
        a.append_slots(1, [i])
    assert calls == [] and a.num_tokens(1) == 29


def test_statistics_count_queries_hits_and_peak() -> None:
    a = PagedBlockAllocator(16, 4, 64)
    a.allocate(1, list(range(10)))
    a.allocate(2, list(range(10)))
    s = a.stats()
    assert (s.prefix_queries, s.prefix_hits) == (20, 8) and s.prefix_hit_rate == 0.4
    assert (s.used_blocks, s.used_slots, s.reserved_slots) == (4, 12, 16)  # 2 shared + 2 own tails
    assert s.fragmentation == pytest.approx(1 - 12 / 16)
    a.free(1)
    a.free(2)
    s = a.stats()
    assert (s.used_blocks, s.peak_used_blocks, s.cached_free_blocks, s.free_blocks) == (0, 4, 2, 14)


def test_out_of_blocks_message_names_the_shortfall() -> None:
    a = PagedBlockAllocator(4, 4, 64)
    a.allocate(1, list(range(12)))
    message = assert_rejected(a, [1], lambda: a.allocate(2, list(range(50, 58))), 2)
    assert "needs 2 free block(s), 1 of 4 are free" in message
    a.append_slots(1, [0, 1, 2, 3])
    message = assert_rejected(a, [1], lambda: a.append_slots(1, [5]), 1)
    assert "needs 1 free block(s), 0 of 4 are free" in message
    assert not a.can_append(1, 1) and a.can_append(1, 0)


def test_errors_are_kv_cache_errors() -> None:
    a = PagedBlockAllocator(4, 4, 8)
    with pytest.raises(KVCacheError, match="unknown sequence 3; live sequences: \\(none\\)"):
        a.free(3)
