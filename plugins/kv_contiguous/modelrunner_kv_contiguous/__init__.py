"""modelrunner plugin: the ``contiguous`` KV-cache allocator, a static per-sequence reservation."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

from modelrunner.api import BlockAllocator, BlockCopy, KVCacheError, KVCacheStats, hookimpl

if TYPE_CHECKING:
    from modelrunner.api import Registry

__all__ = ["ContiguousBlockAllocator", "allocate", "register"]


class ContiguousBlockAllocator(BlockAllocator):
    """Each sequence reserves ``ceil(max_model_len / block_size)`` consecutive blocks up front.

    The pool is cut into equal reservations; blocks left over after the last whole reservation are
    never handed out (they count as free). No prefix caching: :meth:`allocate` always returns 0.
    :meth:`fork` takes a fresh reservation and returns the copies of the parent's used blocks.
    """

    name = "contiguous"
    shares_blocks_on_fork = False
    """``fork`` copies the parent's used blocks into a new reservation."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = False,
    ) -> None:
        # Prefix caching is not supported (supports_prefix_caching stays False): the flag is accepted and ignored.
        super().__init__(num_blocks, block_size, max_model_len, enable_prefix_caching)
        self.blocks_per_seq = -(-max_model_len // block_size)
        """Blocks in one reservation."""
        self.num_reservations = num_blocks // self.blocks_per_seq
        """Sequences that fit at once."""
        self._free_reservations = list(range(self.num_reservations))  # a heap: lowest index first
        self._seqs: dict[int, tuple[int, int]] = {}  # seq_id -> (reservation index, num_tokens)
        self._live_reservations: set[int] = set()
        self._used_slots = 0
        self._peak_used = 0
        self._prefix_queries = 0

    def _get(self, seq_id: int) -> tuple[int, int]:
        entry = self._seqs.get(seq_id)
        if entry is None:
            live = ", ".join(map(repr, sorted(self._seqs, key=repr)[:10])) or "(none)"
            raise KVCacheError(f"unknown sequence {seq_id!r}; live sequences: {live}")
        return entry

    def _check_length(self, seq_id: int, total: int) -> None:
        if total > self.max_model_len:
            raise KVCacheError(
                f"sequence {seq_id!r} would hold {total} tokens, more than max_model_len={self.max_model_len}"
            )

    def _take_reservation(self, seq_id: int) -> int:
        if not self._free_reservations:
            raise KVCacheError(
                f"out of KV-cache blocks: sequence {seq_id!r} needs a reservation of {self.blocks_per_seq} blocks; "
                f"all {self.num_reservations} reservations of the {self.num_blocks}-block pool are in use"
            )
        index = heapq.heappop(self._free_reservations)
        self._live_reservations.add(index)
        self._peak_used = max(self._peak_used, len(self._live_reservations) * self.blocks_per_seq)
        return index

    def can_allocate(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> bool:
        return 0 < len(token_ids) <= self.max_model_len and bool(self._free_reservations)

    def allocate(self, seq_id: int, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id!r} is already allocated; free it first or use a new id")
        if len(token_ids) == 0:
            raise KVCacheError(f"sequence {seq_id!r}: allocate needs at least one token, got none")
        self._check_length(seq_id, len(token_ids))
        self._seqs[seq_id] = (self._take_reservation(seq_id), len(token_ids))
        self._used_slots += len(token_ids)
        self._prefix_queries += len(token_ids)
        return 0

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        return self._get(seq_id)[1] + num_new_tokens <= self.max_model_len

    def append_slots(self, seq_id: int, token_ids: Sequence[int]) -> list[BlockCopy]:
        index, num_tokens = self._get(seq_id)
        self._check_length(seq_id, num_tokens + len(token_ids))
        self._seqs[seq_id] = (index, num_tokens + len(token_ids))
        self._used_slots += len(token_ids)
        return []

    def fork(self, parent_id: int, child_id: int) -> list[BlockCopy]:
        parent_index, num_tokens = self._get(parent_id)
        if child_id in self._seqs:
            raise KVCacheError(f"cannot fork {parent_id!r} into {child_id!r}: sequence {child_id!r} is already live")
        child_index = self._take_reservation(child_id)
        self._seqs[child_id] = (child_index, num_tokens)
        self._used_slots += num_tokens
        r = self.blocks_per_seq
        used = -(-num_tokens // self.block_size)
        return [(parent_index * r + i, child_index * r + i) for i in range(used)]

    def free(self, seq_id: int) -> None:
        index, num_tokens = self._get(seq_id)
        del self._seqs[seq_id]
        self._live_reservations.discard(index)
        heapq.heappush(self._free_reservations, index)
        self._used_slots -= num_tokens

    def block_table(self, seq_id: int) -> list[int]:
        """The whole reservation (tokens so far use its leading blocks)."""
        start = self._get(seq_id)[0] * self.blocks_per_seq
        return list(range(start, start + self.blocks_per_seq))

    def num_tokens(self, seq_id: int) -> int:
        return self._get(seq_id)[1]

    def ref_count(self, block_id: int) -> int:
        """1 when ``block_id`` lies in a live reservation, else 0 (blocks are never shared)."""
        return int(block_id // self.blocks_per_seq in self._live_reservations)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def stats(self) -> KVCacheStats:
        used = len(self._live_reservations) * self.blocks_per_seq
        return KVCacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            used_blocks=used,
            cached_free_blocks=0,
            free_blocks=self.num_blocks - used,
            peak_used_blocks=self._peak_used,
            prefix_queries=self._prefix_queries,
            prefix_hits=0,
            reserved_slots=used * self.block_size,
            used_slots=self._used_slots,
        )


@hookimpl
def register(registry: Registry) -> None:
    """Declare the ``contiguous`` allocator."""
    registry.allocators(ContiguousBlockAllocator.name, prefix_caching=False)


@hookimpl
def allocate(num_blocks: int, block_size: int, max_model_len: int) -> ContiguousBlockAllocator:
    """A fresh :class:`ContiguousBlockAllocator` (the kernel calls this only for ``contiguous``)."""
    return ContiguousBlockAllocator(num_blocks, block_size, max_model_len)
