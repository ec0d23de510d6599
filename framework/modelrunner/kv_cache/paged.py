"""The kernel's paged block allocator: ref-counted blocks, an LRU free queue, a prefix cache."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from .allocator import BlockAllocator, BlockCopy, KVCacheError, KVCacheStats

BlockKey = tuple
"""``(parent digest, block token ids, extra_keys)``: what a full block's KV depends on.

The parent digest is a SHA-256 chained over every earlier block (and the extra keys), so equal
keys mean equal prefixes; the token ids and extra keys are compared exactly on lookup.
"""

_ROOT = b""
"""The parent digest of a sequence's first block."""


def _chain(parent: bytes, tokens: Sequence[int], extra_keys: tuple) -> tuple[BlockKey, bytes]:
    """The cache key of a full block and the digest its successor chains from.

    ``extra_keys`` enter the first block only; every later block inherits them through the digest.
    """
    tokens = tuple(tokens)
    extra = extra_keys if parent == _ROOT else ()
    digest = hashlib.sha256(parent)
    digest.update(array("q", tokens).tobytes())
    if extra:
        digest.update(repr(extra).encode())
    return (parent, tokens, extra), digest.digest()


class _Sequence:
    """What the allocator remembers of one live sequence."""

    __slots__ = ("block_table", "num_tokens", "partial", "parent_digest", "extra_keys")

    def __init__(self, extra_keys: tuple) -> None:
        self.block_table: list[int] = []
        self.num_tokens = 0
        self.partial: list[int] = []  # token ids in the last, not yet full, block
        self.parent_digest = _ROOT  # digest of the last full block (the chain so far)
        self.extra_keys = extra_keys

    def copy(self) -> _Sequence:
        other = _Sequence(self.extra_keys)
        other.block_table = list(self.block_table)
        other.num_tokens = self.num_tokens
        other.partial = list(self.partial)
        other.parent_digest = self.parent_digest
        return other


class PagedBlockAllocator(BlockAllocator):
    """Blocks handed out on demand, shared by reference count, reused through a prefix cache.

    Free blocks wait in an LRU queue: blocks holding nothing reusable at its front, full blocks
    with a registered prefix hash behind them in the order they were freed. A new block is taken
    from the front (evicting its hash if it had one); a prefix-cache hit takes its block out of the
    queue wherever it is. Every operation is O(1) per block touched; hashing happens only when a
    block fills.
    """

    name = "paged"
    supports_prefix_caching = True
    shares_blocks_on_fork = True
    """``fork`` shares blocks; the first append to a shared partial block copies it."""
    supports_lookahead = True
    """Lookahead blocks sit at the end of the block table until appended into or released."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        super().__init__(num_blocks, block_size, max_model_len, enable_prefix_caching)
        self._ref_counts = [0] * num_blocks
        self._fill = [0] * num_blocks  # token slots written in each block
        self._block_key: list[BlockKey | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._num_cached_free = 0
        self._cache: dict[BlockKey, int] = {}
        self._seqs: dict[int, _Sequence] = {}
        self._peak_used = 0
        self._used_slots = 0
        self._prefix_queries = 0
        self._prefix_hits = 0

    # -- queries ---------------------------------------------------------------------------------

    def _seq(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KVCacheError(f"unknown sequence {seq_id!r}; live sequences: {self._live_ids()}")
        return seq

    def _live_ids(self) -> str:
        ids = sorted(self._seqs, key=repr)
        return ", ".join(map(repr, ids[:10])) + (f", ... ({len(ids)} in all)" if len(ids) > 10 else "") or "(none)"

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).block_table)

    def num_tokens(self, seq_id: int) -> int:
        return self._seq(seq_id).num_tokens

    def ref_count(self, block_id: int) -> int:
        """How many live sequences hold ``block_id`` (0 when it is free)."""
        return self._ref_counts[block_id]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def stats(self) -> KVCacheStats:
        used = self.num_blocks - len(self._free)
        return KVCacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            used_blocks=used,
            cached_free_blocks=self._num_cached_free,
            free_blocks=len(self._free) - self._num_cached_free,
            peak_used_blocks=self._peak_used,
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
            reserved_slots=used * self.block_size,
            used_slots=self._used_slots,
        )

    # -- prefix cache ------------------------------------------------------------------------------

    def _find_cached_prefix(self, token_ids: Sequence[int], extra_keys: tuple) -> tuple[list[int], bytes]:
        """Blocks already holding a prefix of ``token_ids`` (at most ``len - 1`` tokens), and the chain digest."""
        hits: list[int] = []
        parent = _ROOT
        if not self.enable_prefix_caching:
            return hits, parent
        bs = self.block_size
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            key, digest = _chain(parent, token_ids[start : start + bs], extra_keys)
            block = self._cache.get(key)
            if block is None:
                break
            hits.append(block)
            parent = digest
        return hits, parent

    def _register_full_block(self, seq: _Sequence, block: int) -> None:
        key, seq.parent_digest = _chain(seq.parent_digest, seq.partial, seq.extra_keys)
        seq.partial = []
        if key not in self._cache:
            self._cache[key] = block
            self._block_key[block] = key

    # -- block pool ----------------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._block_key[block]
        if key is not None:  # evict: its prefix is no longer reusable
            self._num_cached_free -= 1
            del self._cache[key]
            self._block_key[block] = None
        self._ref_counts[block] = 1
        self._fill[block] = 0
        return block

    def _revive(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free[block]
            self._num_cached_free -= 1
            self._used_slots += self._fill[block]
        self._ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._used_slots -= self._fill[block]
            self._free[block] = None
            if self._block_key[block] is None:
                self._free.move_to_end(block, last=False)  # nothing to keep: reuse it first
            else:
                self._num_cached_free += 1

    def _note_peak(self) -> None:
        used = self.num_blocks - len(self._free)
        if used > self._peak_used:
            self._peak_used = used

    def _write(self, seq: _Sequence, token_ids: Sequence[int]) -> None:
        """Record ``token_ids`` in the sequence's (already reserved) slots, registering blocks that fill."""
        bs = self.block_size
        caching = self.enable_prefix_caching
        table = seq.block_table
        pos = seq.num_tokens
        end = pos + len(token_ids)
        done = 0
        while pos < end:
            block = table[pos // bs]
            take = min(bs - pos % bs, end - pos)
            if caching:
                seq.partial.extend(token_ids[done : done + take])
            done += take
            pos += take
            self._fill[block] = (pos - 1) % bs + 1
            if caching and pos % bs == 0:
                self._register_full_block(seq, block)
        self._used_slots += len(token_ids)
        seq.num_tokens = pos

    def _check_length(self, seq_id: int, total: int) -> None:
        if total > self.max_model_len:
            raise KVCacheError(
                f"sequence {seq_id!r} would hold {total} tokens, more than max_model_len={self.max_model_len}"
            )

    def _out_of_blocks(self, seq_id: int, needed: int) -> KVCacheError:
        return KVCacheError(
            f"out of KV-cache blocks: sequence {seq_id!r} needs {needed} free block(s), "
            f"{len(self._free)} of {self.num_blocks} are free"
        )

    # -- new sequences ---------------------------------------------------------------------------------

    def _blocks_needed(self, token_ids: Sequence[int], hits: list[int]) -> int:
        """Free blocks an allocate would consume: new blocks plus cached-free hits it takes out of the queue."""
        new = -(-len(token_ids) // self.block_size) - len(hits)
        return new + sum(1 for b in hits if self._ref_counts[b] == 0)

    def cached_prefix_len(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
        hits, _ = self._find_cached_prefix(token_ids, tuple(extra_keys))
        return len(hits) * self.block_size

    def can_allocate(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> bool:
        if not 0 < len(token_ids) <= self.max_model_len:
            return False
        hits, _ = self._find_cached_prefix(token_ids, extra_keys)
        return self._blocks_needed(token_ids, hits) <= len(self._free)

    def allocate(self, seq_id: int, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id!r} is already allocated; free it first or use a new id")
        if len(token_ids) == 0:
            raise KVCacheError(f"sequence {seq_id!r}: allocate needs at least one token, got none")
        self._check_length(seq_id, len(token_ids))
        extra_keys = tuple(extra_keys)
        hits, parent = self._find_cached_prefix(token_ids, extra_keys)
        needed = self._blocks_needed(token_ids, hits)
        if needed > len(self._free):
            raise self._out_of_blocks(seq_id, needed)

        seq = _Sequence(extra_keys)
        for block in hits:
            self._revive(block)
        num_cached = len(hits) * self.block_size
        seq.block_table = hits
        seq.num_tokens = num_cached
        seq.parent_digest = parent
        for _ in range(-(-len(token_ids) // self.block_size) - len(hits)):
            seq.block_table.append(self._take_free_block())
        self._write(seq, token_ids[num_cached:])
        self._seqs[seq_id] = seq
        self._prefix_queries += len(token_ids)
        self._prefix_hits += num_cached
        self._note_peak()
        return num_cached

    # -- growing sequences -------------------------------------------------------------------------------

    def _append_cost(self, seq: _Sequence, num_new_tokens: int) -> tuple[bool, int]:
        """Whether the last block must be copied first, and how many free blocks the append takes."""
        bs = self.block_size
        copy_last = (num_new_tokens > 0 and seq.num_tokens % bs != 0
                     and self._ref_counts[seq.block_table[seq.num_tokens // bs]] > 1)
        new = max(0, -(-(seq.num_tokens + num_new_tokens) // bs) - len(seq.block_table))
        return copy_last, new + copy_last

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        seq = self._seq(seq_id)
        if seq.num_tokens + num_new_tokens > self.max_model_len:
            return False
        return self._append_cost(seq, num_new_tokens)[1] <= len(self._free)

    def append_slots(self, seq_id: int, token_ids: Sequence[int]) -> list[BlockCopy]:
        seq = self._seq(seq_id)
        n = len(token_ids)
        pos = seq.num_tokens
        if pos + n > self.max_model_len:
            self._check_length(seq_id, pos + n)
        bs = self.block_size
        last = seq.block_table[pos // bs] if pos % bs else -1
        if n == 1 and pos % bs and self._ref_counts[last] == 1:
            # The decode fast path: one token into a block this sequence holds alone.
            seq.num_tokens = pos + 1
            self._fill[last] += 1
            self._used_slots += 1
            if self.enable_prefix_caching:
                seq.partial.append(token_ids[0])
                if (pos + 1) % bs == 0:
                    self._register_full_block(seq, last)
            return []
        copy_last, needed = self._append_cost(seq, n)
        if needed > len(self._free):
            raise self._out_of_blocks(seq_id, needed)

        copies: list[BlockCopy] = []
        if copy_last:
            src = seq.block_table[pos // bs]
            dst = self._take_free_block()
            self._fill[dst] = self._fill[src]
            self._used_slots += self._fill[dst]
            self._release(src)
            seq.block_table[pos // bs] = dst
            copies.append((src, dst))
        for _ in range(needed - copy_last):
            seq.block_table.append(self._take_free_block())
        self._write(seq, token_ids)
        self._note_peak()
        return copies

    def reserve_lookahead(self, seq_id: int, num_slots: int) -> bool:
        seq = self._seq(seq_id)
        total = seq.num_tokens + num_slots
        if total > self.max_model_len:
            return False
        bs = self.block_size
        if seq.num_tokens % bs and self._ref_counts[seq.block_table[seq.num_tokens // bs]] > 1:
            return False  # a shared partial block: the next append_slots copies it first
        needed = max(0, -(-total // bs) - len(seq.block_table))
        if needed > len(self._free):
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        self._note_peak()
        return True

    def release_lookahead(self, seq_id: int) -> None:
        seq = self._seq(seq_id)
        keep = -(-seq.num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def fork(self, parent_id: int, child_id: int) -> list[BlockCopy]:
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise KVCacheError(f"cannot fork {parent_id!r} into {child_id!r}: sequence {child_id!r} is already live")
        for block in parent.block_table:
            self._ref_counts[block] += 1
        self._seqs[child_id] = parent.copy()
        return []

    def forget_uncomputed(self, seq_id: int, start: int) -> None:
        seq = self._seq(seq_id)
        for block in seq.block_table[start // self.block_size:]:
            key = self._block_key[block]
            if key is not None and self._cache.get(key) == block:
                del self._cache[key]
                self._block_key[block] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, when no sequence holds a block (else refuse and return False)."""
        if self._seqs:
            return False
        self._cache.clear()
        self._block_key = [None] * self.num_blocks
        self._num_cached_free = 0
        return True

    def free(self, seq_id: int) -> None:
        seq = self._seq(seq_id)
        # Tail first, so a prompt's leading blocks are the last of it to be evicted.
        for block in reversed(seq.block_table):
            self._release(block)
        del self._seqs[seq_id]
