"""The block-allocator interface every KV-cache allocator plugin implements."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import attrs


class KVCacheError(RuntimeError):
    """Raised for misuse of an allocator (unknown sequence, too long, out of blocks).

    The allocator's state is unchanged when this is raised.
    """


@attrs.frozen
class KVCacheStats:
    """A snapshot of an allocator's pool (the article's MemoryManager statistics, made true)."""

    num_blocks: int
    """Blocks in the pool."""
    block_size: int
    """Token slots per block."""
    used_blocks: int
    """Blocks held by at least one live sequence."""
    cached_free_blocks: int
    """Free blocks that still hold a reusable prefix (evictable, revived on a cache hit)."""
    free_blocks: int
    """Free blocks holding nothing reusable."""
    peak_used_blocks: int
    """Highest ``used_blocks`` seen since creation."""
    prefix_queries: int
    """Prompt tokens looked up in the prefix cache."""
    prefix_hits: int
    """Of those, tokens found cached (their KV is not recomputed)."""
    reserved_slots: int
    """Token slots in used blocks."""
    used_slots: int
    """Of those, slots holding a token of a live sequence."""

    @property
    def fragmentation(self) -> float:
        """Internal fragmentation: the fraction of reserved slots not holding a token."""
        return 0.0 if self.reserved_slots == 0 else 1.0 - self.used_slots / self.reserved_slots

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens that were cached."""
        return 0.0 if self.prefix_queries == 0 else self.prefix_hits / self.prefix_queries

    def as_dict(self) -> dict[str, float]:
        """All fields plus the derived ratios, for printing or JSON."""
        d = attrs.asdict(self)
        d["fragmentation"] = self.fragmentation
        d["prefix_hit_rate"] = self.prefix_hit_rate
        return d


BlockCopy = tuple[int, int]
"""``(src_block, dst_block)``: the caller copies the KV contents of ``src`` into ``dst`` before
running the step (copy-on-write of a shared partial block)."""


class BlockAllocator(abc.ABC):
    """Hands out fixed-size KV-cache blocks to sequences.

    The engine tells the allocator, step by step, which tokens of a sequence are about to be
    computed; the allocator reserves slots for them and answers with the sequence's block table.
    Token ids are passed so that allocators with prefix caching can hash full blocks.
    Every method that raises :class:`KVCacheError` leaves the allocator's state unchanged.

    Two class attributes declare what the allocator can do; the engine and the contract suite
    (:mod:`modelrunner_kit.allocator_contract`) read them, so leave them at their defaults unless the
    allocator really does it:

    - ``supports_prefix_caching`` (default False): :meth:`allocate` can report cached leading
      tokens. When False, ``enable_prefix_caching`` is always False, whatever the config asks.
    - ``shares_blocks_on_fork`` (default False): :meth:`fork` shares the parent's blocks
      (copy-on-write) instead of copying them.

    :param num_blocks: blocks in the pool; ``block_size`` token slots per block; ``max_model_len``
        the longest sequence (all positive integers, checked here).
    :param enable_prefix_caching: reuse cached prefixes (honoured only with ``supports_prefix_caching``).
    :raises ValueError: a size that is not a positive integer.
    """

    name: str = "?"
    """The name the allocator is registered under (``kv_allocator`` in the config)."""
    supports_prefix_caching: bool = False
    """True when :meth:`allocate` can find a prompt's leading blocks already cached."""
    shares_blocks_on_fork: bool = False
    """True when :meth:`fork` shares the parent's blocks (copy-on-write) instead of copying them;
    the contract suite then also checks the sharing rules."""
    supports_lookahead: bool = False
    """True when :meth:`reserve_lookahead` and :meth:`release_lookahead` are implemented (speculative
    decoding needs them: without, sequences do not speculate)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        for field, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_model_len", max_model_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        """Blocks in the pool."""
        self.block_size = block_size
        """Token slots per block."""
        self.max_model_len = max_model_len
        """The longest sequence the allocator hands slots to."""
        self.enable_prefix_caching = bool(enable_prefix_caching) and self.supports_prefix_caching
        """Whether prompts' leading blocks are reused (the config's wish, if the allocator can)."""

    @abc.abstractmethod
    def can_allocate(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> bool:
        """Whether :meth:`allocate` for these tokens would succeed now (counting prefix hits)."""

    @abc.abstractmethod
    def allocate(self, seq_id: int, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
        """Start sequence ``seq_id`` with slots for ``token_ids`` (its first tokens to compute).

        :param extra_keys: hashable values that also identify the content (e.g. image hashes), so
            the same tokens with different extra inputs never share cached blocks.
        :returns: how many leading tokens are already cached (a multiple of ``block_size``, at most
            ``len(token_ids) - 1``); their KV need not be recomputed.
        :raises KVCacheError: ``seq_id`` is live, the tokens exceed ``max_model_len``, or there are not
            enough free blocks.
        """

    @abc.abstractmethod
    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        """Whether :meth:`append_slots` with that many tokens would succeed now."""

    @abc.abstractmethod
    def append_slots(self, seq_id: int, token_ids: Sequence[int]) -> list[BlockCopy]:
        """Reserve slots for ``token_ids``, the next tokens of ``seq_id`` to compute.

        :returns: block copies to perform before the step (copy-on-write of a shared last block).
        :raises KVCacheError: unknown sequence, past ``max_model_len``, or out of blocks.
        """

    @abc.abstractmethod
    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks (cached full blocks stay reusable until evicted).

        :raises KVCacheError: unknown sequence.
        """

    @abc.abstractmethod
    def fork(self, parent_id: int, child_id: int) -> list[BlockCopy]:
        """Make ``child_id`` a copy of ``parent_id`` (for ``n > 1`` sampling).

        Paged allocators share the parent's blocks; the first append to a shared partial block
        copies it. :returns: block copies to perform now (for allocators that cannot share).
        :raises KVCacheError: unknown parent, live child, or out of blocks.
        """

    @abc.abstractmethod
    def block_table(self, seq_id: int) -> list[int]:
        """The block ids of the sequence, in order. :raises KVCacheError: unknown sequence."""

    @abc.abstractmethod
    def num_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence that have slots. :raises KVCacheError: unknown sequence."""

    @abc.abstractmethod
    def stats(self) -> KVCacheStats:
        """A snapshot of the pool's statistics."""

    def __contains__(self, seq_id: int) -> bool:
        try:
            self.num_tokens(seq_id)
        except KVCacheError:
            return False
        return True

    def cached_prefix_len(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
        """How many leading tokens of ``token_ids`` :meth:`allocate` would find cached now (0 without
        prefix caching). The scheduler asks before allocating the first chunk of a long prompt, so
        that a cached prefix longer than one chunk is reused whole."""
        return 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after changing the weights in place). Returns False, changing
        nothing, while a sequence holds blocks. The default (no prefix caching) has nothing to forget."""
        return True

    def forget_uncomputed(self, seq_id: int, start: int) -> None:
        """The sequence's tokens from ``start`` on were never computed (their forward failed):
        make sure no prefix-cache lookup returns the blocks holding them.

        The default does nothing, which is right for allocators without prefix caching; those that
        register blocks for reuse must override it. :raises KVCacheError: unknown sequence.
        """
        self.num_tokens(seq_id)

    def reserve_lookahead(self, seq_id: int, num_slots: int) -> bool:
        """Hold slots for ``num_slots`` tokens after the sequence's tokens without recording any token
        in them: speculative decoding writes its draft tokens' KV there, and only the drafts the target
        model accepts become the sequence's tokens (a later :meth:`append_slots` of them uses these slots,
        which must stay where they are). Nothing enters the prefix cache here.

        :returns: False, changing nothing, when there are not enough free blocks (or past ``max_model_len``).
        :raises KVCacheError: unknown sequence; NotImplementedError without ``supports_lookahead``.
        """
        raise NotImplementedError(f"allocator {self.name!r} cannot reserve lookahead slots")

    def release_lookahead(self, seq_id: int) -> None:
        """Give back the blocks :meth:`reserve_lookahead` held that hold no token of the sequence now.

        :raises KVCacheError: unknown sequence; NotImplementedError without ``supports_lookahead``.
        """
        raise NotImplementedError(f"allocator {self.name!r} cannot release lookahead slots")

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat cache slots of the sequence's tokens ``start:end`` (``block * block_size + offset``)."""
        table = self.block_table(seq_id)
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
