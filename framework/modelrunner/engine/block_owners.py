"""The engine's own count of which KV blocks its live sequences hold.

An allocator plugin that hands out, as new, a block another live sequence still holds makes both
write their keys and values into it: the other request's output changes, silently. The contract
suite (``modelrunner check``) catches such an allocator; this catches it at run time, at the cost of
a look at each block when it is handed out and when it is given back.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..errors import FatalError
from ..kv_cache.allocator import BlockCopy


class BlockOwnershipError(FatalError):
    """The KV allocator handed out, as new, a block a live sequence still holds."""


class BlockOwners:
    """Block tables of the sequences the engine runs on ``allocator``, as they were handed out.

    Callers report every sequence they start (:meth:`allocated`), fork (:meth:`forked`), grow
    (:meth:`appended`) and free (:meth:`freed`); each new block is checked against the blocks the
    other sequences hold. Prefix-cache hits and forks share blocks on purpose and are not checked.
    """

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        """The allocator whose hand-outs are checked."""
        self._tables: dict[int, list[int]] = {}
        self._holders: Counter[int] = Counter()

    def allocated(self, seq_id: int, num_cached_tokens: int) -> None:
        """``seq_id`` was allocated; its first ``num_cached_tokens`` tokens were prefix-cache hits."""
        table = self.allocator.block_table(seq_id)
        self._take(seq_id, table, num_cached_tokens // self.allocator.block_size)

    def forked(self, parent_id: int, child_id: int) -> None:
        """``child_id`` was forked from ``parent_id`` (sharing its blocks, or holding copies of them)."""
        table = self.allocator.block_table(child_id)
        shared = self._tables.get(parent_id, [])
        self._take(child_id, table, sum(1 for a, b in zip(table, shared) if a == b))

    def appended(self, seq_id: int, num_tokens: int, copies: list[BlockCopy]) -> None:
        """``seq_id`` now has slots for ``num_tokens`` tokens; ``copies`` were its copy-on-writes."""
        old = self._tables.get(seq_id)
        if old is None:
            return  # not a sequence reported here
        if not copies and -(-num_tokens // self.allocator.block_size) <= len(old):
            return  # the decode fast path: no block changed hands
        table = self.allocator.block_table(seq_id)
        # Usually only the tail changes: new blocks after the old ones, or a copy replacing the last
        # one; an allocator that moved more (copying several blocks) costs a scan of the table.
        keep = len(old)
        if len(copies) > 1 or table[keep - 1:keep] != old[-1:]:
            keep = next((i for i, (a, b) in enumerate(zip(old, table)) if a != b), min(len(old), len(table)))
        for block in old[keep:]:
            self._release(block)
        del old[keep:]
        self._hold_new(seq_id, table[keep:])

    def trimmed(self, seq_id: int) -> None:
        """``seq_id`` gave back blocks at the end of its table (speculative lookahead it did not use)."""
        old = self._tables.get(seq_id)
        if old is None:
            return
        keep = len(self.allocator.block_table(seq_id))
        for block in old[keep:]:
            self._release(block)
        del old[keep:]

    def freed(self, seq_id: int) -> None:
        """``seq_id``'s blocks were given back."""
        for block in self._tables.pop(seq_id, ()):
            self._release(block)

    def _take(self, seq_id: int, table: list[int], num_shared: int) -> None:
        for block in table[:num_shared]:
            self._holders[block] += 1
        self._tables[seq_id] = table[:num_shared]
        self._hold_new(seq_id, table[num_shared:])

    def _release(self, block: int) -> None:
        self._holders[block] -= 1
        if not self._holders[block]:
            del self._holders[block]

    def _hold_new(self, seq_id: int, new_blocks: list[int]) -> None:
        mine = self._tables[seq_id]
        for block in new_blocks:
            if self._holders[block] > 0:
                holders = sorted(s for s, t in self._tables.items() if block in t)
                name = getattr(self.allocator, "name", "?")
                raise BlockOwnershipError(
                    f"KV allocator {name!r} ({type(self.allocator).__name__}) handed out block {block} as a new "
                    f"block to sequence {seq_id!r} while sequence(s) {holders} hold it: both would write their KV "
                    "into it and change each other's output. The allocator is broken; `modelrunner check <its "
                    "plugin> --kind allocators` shows which rule it breaks")
            self._holders[block] += 1
            mine.append(block)
