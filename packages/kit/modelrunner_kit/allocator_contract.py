"""The contract every KV-cache block allocator must keep, as a reusable pytest suite.

An allocator plugin tests itself by subclassing :class:`AllocatorContract`::

    from modelrunner_kit.allocator_contract import AllocatorContract

    class TestMyAllocator(AllocatorContract):
        supports_prefix_caching = False

        def make_allocator(self, num_blocks, block_size, max_model_len, enable_prefix_caching=True):
            return MyAllocator(num_blocks, block_size, max_model_len)

The suite drives only the public :class:`~modelrunner.kv_cache.allocator.BlockAllocator` interface
and checks every answer against a model of what the engine did, including fake KV contents written
through ``slot_mapping`` and moved by the returned block copies. It needs pytest and hypothesis.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from hypothesis.stateful import run_state_machine_as_test

from modelrunner.api import BlockAllocator, BlockCopy, KVCacheError

MakeAllocator = Callable[[int, int, int, bool], BlockAllocator]
"""``(num_blocks, block_size, max_model_len, enable_prefix_caching) -> allocator``."""


def token_contents(extra_keys: tuple, token_ids: Iterable[int]) -> list[int]:
    """Fake KV for each position: a chained hash of every token up to it, like real KV depends on."""
    h = hash(("root", extra_keys))
    out = []
    for token in token_ids:
        h = hash((h, token))
        out.append(h)
    return out


class FakeKV:
    """KV "contents" by flat slot, written and copied the way a model runner would."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}

    def write(self, slots: list[int], contents: list[int]) -> None:
        """Store ``contents`` at ``slots`` (one step's new K/V)."""
        self.slots.update(zip(slots, contents))

    def read(self, slots: list[int]) -> list[int | None]:
        """What ``slots`` hold (None where nothing was written)."""
        return [self.slots.get(s) for s in slots]

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Perform an allocator's block copies (all read before any is written, like ``copy_blocks``)."""
        bs = self.block_size
        staged = [(dst, [self.slots.get(src * bs + i) for i in range(bs)]) for src, dst in copies]
        for dst, values in staged:
            for i, value in enumerate(values):
                if value is None:
                    self.slots.pop(dst * bs + i, None)
                else:
                    self.slots[dst * bs + i] = value


def snapshot(allocator: BlockAllocator, seq_ids: Iterable[int]) -> tuple:
    """Everything observable about ``allocator`` for these sequences (to compare before/after an error)."""
    return allocator.stats(), {s: (allocator.block_table(s), allocator.num_tokens(s)) for s in seq_ids}


def assert_rejected(allocator: BlockAllocator, seq_ids: Iterable[int], call: Callable[[], Any], *mentions: Any) -> str:
    """``call`` raises :class:`KVCacheError` naming each of ``mentions`` and leaves the state unchanged."""
    seq_ids = list(seq_ids)
    before = snapshot(allocator, seq_ids)
    with pytest.raises(KVCacheError) as excinfo:
        call()
    message = str(excinfo.value)
    for m in mentions:
        assert str(m) in message, f"error message {message!r} does not mention {m!r}"
    assert snapshot(allocator, seq_ids) == before, f"state changed by a rejected call ({message})"
    return message


def check_consistency(allocator: BlockAllocator, seqs: dict[int, list[int]]) -> None:
    """Stats agree with the block tables of the live sequences ``seqs`` (id → token ids)."""
    stats = allocator.stats()
    bs = allocator.block_size
    assert stats.used_blocks + stats.cached_free_blocks + stats.free_blocks == allocator.num_blocks, stats
    assert min(stats.used_blocks, stats.cached_free_blocks, stats.free_blocks) >= 0, stats
    assert stats.peak_used_blocks >= stats.used_blocks, stats
    assert stats.reserved_slots == stats.used_blocks * bs, stats
    assert 0 <= stats.prefix_hits <= stats.prefix_queries, stats
    holders: dict[int, list[int]] = {}  # block -> tokens of each holder in that block
    slots: set[int] = set()
    for seq_id, tokens in seqs.items():
        assert seq_id in allocator
        n = allocator.num_tokens(seq_id)
        assert n == len(tokens), f"sequence {seq_id}: allocator says {n} tokens, engine gave {len(tokens)}"
        table = allocator.block_table(seq_id)
        assert len(table) >= -(-n // bs), f"sequence {seq_id}: {len(table)} blocks cannot hold {n} tokens"
        assert len(set(table)) == len(table), f"sequence {seq_id} holds a block twice: {table}"
        assert all(0 <= b < allocator.num_blocks for b in table), table
        for i, block in enumerate(table):
            holders.setdefault(block, []).append(max(0, min(bs, n - i * bs)))
        slots.update(allocator.slot_mapping(seq_id, 0, n))
    assert stats.used_blocks == len(holders), f"{stats.used_blocks} used blocks, live sequences hold {len(holders)}"
    assert stats.used_slots == len(slots), f"{stats.used_slots} used slots, live sequences hold {len(slots)}"
    for block, fills in holders.items():
        # Sequences write only into blocks they hold alone (copy-on-write), so sharers agree on the fill.
        assert len(set(fills)) == 1, f"block {block} is shared by sequences holding {fills} tokens in it"
        if hasattr(allocator, "ref_count"):
            assert allocator.ref_count(block) == len(fills), f"block {block}: ref_count != {len(fills)} owners"


class AllocatorContract:
    """Tests every :class:`BlockAllocator` must pass; subclass it and define :meth:`make_allocator`.

    Capabilities that legitimately differ between allocators are class attributes.
    """

    supports_prefix_caching: bool = True
    """``allocate`` may report cached tokens, and does for a prompt seen before while its blocks survive."""
    shares_blocks_on_fork: bool = True
    """``fork`` shares the parent's blocks (copy-on-write) instead of copying them."""
    max_examples: int = 100
    """Hypothesis examples for the stateful test."""
    stateful_step_count: int = 30
    """Steps per stateful example."""

    def make_allocator(
        self, num_blocks: int, block_size: int, max_model_len: int, enable_prefix_caching: bool = True
    ) -> BlockAllocator:
        """A fresh allocator to test (override this)."""
        raise NotImplementedError(f"{type(self).__name__} must define make_allocator")

    # -- allocate -------------------------------------------------------------------------------

    def test_allocate_gives_distinct_slots(self) -> None:
        a = self.make_allocator(64, 4, 32, False)
        a.allocate(1, list(range(10)))
        a.allocate(2, list(range(100, 107)))
        assert a.num_tokens(1) == 10 and a.num_tokens(2) == 7
        s1, s2 = a.slot_mapping(1, 0, 10), a.slot_mapping(2, 0, 7)
        assert len(set(s1)) == 10 and len(set(s2)) == 7 and not set(s1) & set(s2)
        assert 1 in a and 2 in a and 3 not in a
        check_consistency(a, {1: list(range(10)), 2: list(range(100, 107))})

    def test_allocate_rejects_bad_input(self) -> None:
        a = self.make_allocator(64, 4, 16)
        a.allocate(1, [1, 2, 3])
        assert not a.can_allocate(list(range(17)))
        assert_rejected(a, [1], lambda: a.allocate(2, list(range(17))), 17, "max_model_len=16")
        assert_rejected(a, [1], lambda: a.allocate(1, [5]), 1)
        assert not a.can_allocate([])
        assert_rejected(a, [1], lambda: a.allocate(2, []), 2)
        assert 2 not in a

    def test_out_of_blocks_is_clean(self) -> None:
        a = self.make_allocator(16, 4, 16, False)
        live: dict[int, list[int]] = {}
        for seq_id in range(100):
            tokens = [seq_id * 100 + i for i in range(6)]
            if not a.can_allocate(tokens):
                break
            a.allocate(seq_id, tokens)
            live[seq_id] = tokens
        else:
            pytest.fail("a 16-block pool accepted 100 sequences of 6 tokens")
        assert live, "a 16-block pool refused a single sequence of 6 tokens"
        assert_rejected(a, live, lambda: a.allocate(seq_id, tokens), seq_id)
        check_consistency(a, live)
        first = next(iter(live))
        a.free(first)
        del live[first]
        assert a.can_allocate(tokens)
        a.allocate(seq_id, tokens)

    # -- append -----------------------------------------------------------------------------------

    def test_append_grows_to_max_model_len(self) -> None:
        a = self.make_allocator(32, 4, 12, False)
        tokens = [7, 8, 9]
        a.allocate(1, tokens)
        while len(tokens) < 12:
            assert a.can_append(1, 1)
            assert a.append_slots(1, [len(tokens)]) == []
            tokens.append(len(tokens))
            check_consistency(a, {1: tokens})
        assert len(set(a.slot_mapping(1, 0, 12))) == 12
        assert not a.can_append(1, 1)
        assert_rejected(a, [1], lambda: a.append_slots(1, [0]), 13, "max_model_len=12")
        assert a.append_slots(1, []) == []

    def test_unknown_sequence(self) -> None:
        a = self.make_allocator(32, 4, 16)
        a.allocate(1, [1, 2, 3])
        for call in (
            lambda: a.free(42),
            lambda: a.append_slots(42, [1]),
            lambda: a.can_append(42, 1),
            lambda: a.block_table(42),
            lambda: a.num_tokens(42),
            lambda: a.fork(42, 43),
        ):
            assert_rejected(a, [1], call, 42)
        a.free(1)
        assert_rejected(a, [], lambda: a.free(1), 1)

    # -- free ---------------------------------------------------------------------------------------

    def test_free_returns_every_block(self) -> None:
        a = self.make_allocator(64, 4, 32)
        for seq_id in range(4):
            a.allocate(seq_id, [seq_id] * (5 + 3 * seq_id))
            a.append_slots(seq_id, [1, 2])
        a.fork(0, 10)
        a.append_slots(10, [3])
        peak = a.stats().peak_used_blocks
        for seq_id in (0, 1, 2, 3, 10):
            a.free(seq_id)
        s = a.stats()
        assert (s.used_blocks, s.used_slots, s.reserved_slots) == (0, 0, 0)
        assert s.free_blocks + s.cached_free_blocks == 64 and s.peak_used_blocks == peak > 0

    # -- fork -----------------------------------------------------------------------------------------

    def test_fork_then_diverge_keeps_contents(self) -> None:
        bs = 4
        a = self.make_allocator(64, bs, 32)
        kv = FakeKV(bs)
        parent = [5, 6, 7, 8, 9, 10]
        a.allocate(1, parent)
        kv.write(a.slot_mapping(1, 0, 6), token_contents((), parent))
        kv.copy_blocks(a.fork(1, 2))
        assert a.num_tokens(2) == 6
        child = list(parent)
        for seq_id, tokens, new in ((2, child, [11, 12, 13]), (1, parent, [21, 22, 23])):
            kv.copy_blocks(a.append_slots(seq_id, new))
            tokens.extend(new)
            kv.write(a.slot_mapping(seq_id, len(tokens) - 3, len(tokens)), token_contents((), tokens)[-3:])
        for seq_id, tokens in ((1, parent), (2, child)):
            assert kv.read(a.slot_mapping(seq_id, 0, len(tokens))) == token_contents((), tokens)
        check_consistency(a, {1: parent, 2: child})
        assert_rejected(a, [1, 2], lambda: a.fork(1, 2), 2)

    def test_fork_shares_until_written(self) -> None:
        if not self.shares_blocks_on_fork:
            pytest.skip("this allocator copies on fork")
        a = self.make_allocator(64, 4, 32)
        a.allocate(1, list(range(6)))  # one full block, one holding 2 tokens
        parent_table = a.block_table(1)
        used = a.stats().used_blocks
        assert a.fork(1, 2) == []
        assert a.block_table(2) == parent_table and a.stats().used_blocks == used
        copies = a.append_slots(2, [99])
        assert len(copies) == 1 and copies[0][0] == parent_table[1]
        assert a.block_table(2) == [parent_table[0], copies[0][1]] and a.block_table(1) == parent_table
        assert a.append_slots(1, [98]) == [], "the parent holds its last block alone after the child's copy"

    # -- prefix caching -------------------------------------------------------------------------------

    def _require_prefix_caching(self) -> None:
        if not self.supports_prefix_caching:
            pytest.skip("this allocator has no prefix caching")

    def test_prefix_revived_with_same_blocks_and_contents(self) -> None:
        self._require_prefix_caching()
        bs = 4
        a = self.make_allocator(32, bs, 64)
        kv = FakeKV(bs)
        prompt = list(range(14))  # 3 full blocks + 2 tokens
        assert a.allocate(1, prompt) == 0
        kv.write(a.slot_mapping(1, 0, 14), token_contents((), prompt))
        table = a.block_table(1)
        a.free(1)
        assert a.stats().cached_free_blocks >= 3
        assert a.cached_prefix_len(prompt + [99]) in (0, 12)  # 0: the optional look-ahead is not implemented
        cached = a.allocate(2, prompt + [99])
        assert cached == 12
        assert a.block_table(2)[:3] == table[:3]
        assert kv.read(a.slot_mapping(2, 0, 12)) == token_contents((), prompt)[:12]
        assert a.stats().prefix_hits == 12

    def test_prefix_hit_leaves_a_token_to_compute(self) -> None:
        self._require_prefix_caching()
        a = self.make_allocator(32, 4, 64)
        a.allocate(1, list(range(8)))
        assert a.allocate(2, list(range(8))) == 4  # at most len - 1 tokens, whole blocks
        assert a.allocate(3, list(range(9))) == 8
        check_consistency(a, {1: list(range(8)), 2: list(range(8)), 3: list(range(9))})

    def test_prefix_keys_include_extra_keys_and_all_earlier_tokens(self) -> None:
        self._require_prefix_caching()
        a = self.make_allocator(64, 4, 64)
        a.allocate(1, list(range(12)), extra_keys=("image", 1))
        assert a.allocate(2, list(range(12)) + [0], extra_keys=("image", 2)) == 0
        assert a.allocate(3, list(range(12)) + [0], extra_keys=("image", 1)) == 12
        assert a.allocate(4, list(range(12))) == 0  # no extra keys: not the image prompts' blocks
        assert a.allocate(5, [99] * 4 + list(range(4, 12)) + [0]) == 0  # same later blocks, other parent
        assert a.allocate(6, list(range(8)) + [77] * 4 + [0]) == 8

    def test_forgotten_blocks_are_never_prefix_hits(self) -> None:
        a = self.make_allocator(32, 4, 64)
        prompt = list(range(13))  # 3 full blocks + 1 token
        a.allocate(1, prompt)
        a.forget_uncomputed(1, 4)  # the forward that would write tokens 4.. failed
        assert a.allocate(2, prompt) == (4 if self.supports_prefix_caching else 0)
        a.free(1)
        a.free(2)
        assert a.allocate(3, prompt) == (12 if self.supports_prefix_caching else 0)  # 2 wrote them
        with pytest.raises(KVCacheError, match="99"):
            a.forget_uncomputed(99, 0)
        check_consistency(a, {3: prompt})

    def test_prefix_caching_switched_off(self) -> None:
        a = self.make_allocator(32, 4, 64, False)
        a.allocate(1, list(range(9)))
        a.free(1)
        assert a.allocate(2, list(range(9))) == 0
        assert a.stats().cached_free_blocks == 0 and a.stats().prefix_hits == 0

    def test_cached_blocks_are_evicted_under_pressure(self) -> None:
        a = self.make_allocator(8, 4, 32)
        a.allocate(1, list(range(16)))
        a.free(1)
        a.allocate(2, list(range(100, 116)))
        a.free(2)
        big = list(range(200, 232))  # needs all 8 blocks
        assert a.can_allocate(big)
        a.allocate(3, big)
        s = a.stats()
        assert s.used_blocks == 8 and s.cached_free_blocks == 0 and s.free_blocks == 0
        a.free(3)
        assert a.allocate(4, list(range(16))) == 0, "evicted blocks must not be reported as cached"

    # -- speculative decoding's lookahead slots ------------------------------------------------------------

    def test_lookahead_slots(self) -> None:
        """Lookahead slots (``supports_lookahead``): reserved without tokens, appended into in place,
        given back by ``release_lookahead``, never in the prefix cache."""
        a = self.make_allocator(16, 4, 32)
        if not a.supports_lookahead:
            pytest.skip("the allocator does not declare supports_lookahead")
        prompt = list(range(1, 7))  # 6 tokens: a partial second block
        a.allocate(1, prompt)
        assert a.reserve_lookahead(1, 5), "reserving 5 lookahead slots in a 16-block pool failed"
        assert a.num_tokens(1) == 6, "reserve_lookahead must not add tokens"
        table = a.block_table(1)
        assert len(table) >= 3, f"6 tokens + 5 lookahead slots need 3 blocks of 4, the table has {table}"
        a.append_slots(1, [7, 8, 9])  # two drafts accepted, one more token: into the reserved slots
        assert a.block_table(1)[:3] == table[:3], "append_slots after reserve_lookahead moved the reserved blocks"
        a.release_lookahead(1)
        assert len(a.block_table(1)) == 3 and a.num_tokens(1) == 9
        check_consistency(a, {1: prompt + [7, 8, 9]})
        assert not a.reserve_lookahead(1, 32), "reserve_lookahead past max_model_len must refuse"
        assert a.num_tokens(1) == 9 and len(a.block_table(1)) == 3
        a.reserve_lookahead(1, 7)  # slots for tokens 10-16: a full block of drafts that is never appended
        a.release_lookahead(1)
        a.free(1)
        if self.supports_prefix_caching:
            # Only the two blocks of real tokens are cached, not one holding the drafts' slots.
            assert a.allocate(2, prompt + [7, 8, 9] + [0] * 8) == 8

    # -- property-based --------------------------------------------------------------------------------

    def test_state_machine(self) -> None:
        machine = allocator_state_machine(
            self.make_allocator,
            supports_prefix_caching=self.supports_prefix_caching,
            shares_blocks_on_fork=self.shares_blocks_on_fork,
        )
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=self.max_examples,
                stateful_step_count=self.stateful_step_count,
                deadline=None,
                database=None,  # no .hypothesis/ folder in a plugin author's working directory
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )


_BASES = [[random.Random(b).randrange(6) for _ in range(64)] for b in range(3)]
"""Prompt stems that generated prompts share prefixes of (so prefix hits happen)."""


def allocator_state_machine(
    make_allocator: MakeAllocator, *, supports_prefix_caching: bool = True, shares_blocks_on_fork: bool = True
) -> type[RuleBasedStateMachine]:
    """A hypothesis state machine driving one allocator like an engine would, under pressure.

    It allocates prompts sharing stems, re-allocates freed prompts, appends, forks and frees, makes
    bad calls, writes fake KV through ``slot_mapping`` and applies returned copies. After every step:
    no leak, sharing only by fork or by identical full prefix blocks, ref counts equal owners, and
    every live sequence reads back exactly the KV of its own tokens.
    """

    class AllocatorMachine(RuleBasedStateMachine):
        @initialize(
            block_size=st.sampled_from([1, 2, 4]),
            max_model_len=st.integers(4, 20),
            pool=st.integers(1, 3),
            spare=st.integers(0, 4),
            prefix_caching=st.sampled_from([True, True, False]) if supports_prefix_caching else st.just(False),
        )
        def setup(self, block_size: int, max_model_len: int, pool: int, spare: int, prefix_caching: bool) -> None:
            num_blocks = pool * -(-max_model_len // block_size) + spare
            self.a = make_allocator(num_blocks, block_size, max_model_len, prefix_caching)
            self.bs, self.max_len, self.prefix_caching = block_size, max_model_len, prefix_caching
            self.kv = FakeKV(block_size)
            self.live: dict[int, tuple[tuple, list[int]]] = {}  # id -> (extra_keys, tokens)
            self.family: dict[int, int] = {}
            self.freed_prompts: list[tuple[tuple, list[int]]] = []
            self.next_id = 0
            self.hits = 0

        def _new_id(self) -> int:
            self.next_id += 1
            return self.next_id

        def _write(self, seq_id: int, start: int) -> None:
            extra, tokens = self.live[seq_id]
            self.kv.write(self.a.slot_mapping(seq_id, start, len(tokens)), token_contents(extra, tokens)[start:])

        def _allocate(self, tokens: list[int], extra: tuple) -> None:
            seq_id = self._new_id()
            predicted = self.a.can_allocate(tokens, extra)
            if not predicted:
                assert_rejected(self.a, self.live, lambda: self.a.allocate(seq_id, tokens, extra), seq_id)
                return
            cached = self.a.allocate(seq_id, tokens, extra)
            assert cached % self.bs == 0 and 0 <= cached <= len(tokens) - 1, cached
            if not self.prefix_caching:
                assert cached == 0
            self.live[seq_id] = (extra, tokens)
            self.family[seq_id] = seq_id
            # Reused KV must be exactly what computing these tokens would have written.
            assert self.kv.read(self.a.slot_mapping(seq_id, 0, cached)) == token_contents(extra, tokens)[:cached]
            self._write(seq_id, cached)
            self.hits += cached

        @rule(data=st.data(), kind=st.sampled_from(["stem", "stem", "again", "again", "pressure"]))
        def allocate(self, data: st.DataObject, kind: str) -> None:
            """A prompt sharing a stem, a freed prompt again (revival), or a long unshared one (eviction)."""
            if kind == "again" and self.freed_prompts:
                extra, tokens = data.draw(st.sampled_from(self.freed_prompts), label="freed prompt")
            elif kind == "pressure":
                length = data.draw(st.integers(self.max_len // 2, self.max_len), label="pressure length")
                extra, tokens = (), [100 + self.next_id] * length
            else:
                extra = data.draw(st.sampled_from([(), (), ("image", 7)]), label="extra keys")
                stem = _BASES[data.draw(st.integers(0, 2), label="stem")]
                tokens = stem[: data.draw(st.integers(0, self.max_len), label="stem length")]
                tokens = tokens + data.draw(st.lists(st.integers(0, 5), max_size=3), label="suffix")
            self._allocate(tokens, extra)

        @precondition(lambda self: self.freed_prompts)
        @rule(data=st.data())
        def burst_then_return(self, data: st.DataObject) -> None:
            """A burst takes every free block (evicting cached prefixes), ends, and an old prompt returns."""
            stats = self.a.stats()
            length = min(self.max_len, (stats.free_blocks + stats.cached_free_blocks) * self.bs)
            if length:
                self._allocate([100 + self.next_id] * length, ())
                burst = self.next_id
                if burst in self.live:
                    self.a.free(burst)
                    del self.live[burst], self.family[burst]
            extra, tokens = data.draw(st.sampled_from(self.freed_prompts), label="returning prompt")
            self._allocate(tokens, extra)

        def _append(self, seq_id: int, new: list[int]) -> None:
            extra, tokens = self.live[seq_id]
            if not self.a.can_append(seq_id, len(new)):
                assert_rejected(self.a, self.live, lambda: self.a.append_slots(seq_id, new), seq_id)
                return
            self.kv.copy_blocks(self.a.append_slots(seq_id, new))
            start = len(tokens)
            self.live[seq_id] = (extra, tokens + new)
            self._write(seq_id, start)

        @precondition(lambda self: self.live)
        @rule(data=st.data(), new=st.lists(st.integers(0, 5), min_size=1, max_size=5))
        def append(self, data: st.DataObject, new: list[int]) -> None:
            self._append(data.draw(st.sampled_from(sorted(self.live))), new)

        @precondition(lambda self: self.live)
        @rule(data=st.data(), token=st.integers(0, 5), child_first=st.booleans())
        def fork_and_decode(self, data: st.DataObject, token: int, child_first: bool) -> None:
            """Fork (as for ``n > 1`` sampling), then decode one token in each copy: copy-on-write."""
            parent = data.draw(st.sampled_from(sorted(self.live)))
            child = self._fork(parent)
            if child is not None:
                for seq_id in ((child, parent) if child_first else (parent, child)):
                    self._append(seq_id, [token])
                    self.consistent()
                    token += 1

        def _fork(self, parent: int) -> int | None:
            child = self._new_id()
            before = snapshot(self.a, self.live)
            try:
                copies = self.a.fork(parent, child)
            except KVCacheError:
                assert child not in self.a and snapshot(self.a, self.live) == before
                return None
            if shares_blocks_on_fork:
                assert copies == [] and self.a.block_table(child) == self.a.block_table(parent)
            self.kv.copy_blocks(copies)
            self.live[child] = self.live[parent]
            self.family[child] = self.family[parent]
            return child

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def fork(self, data: st.DataObject) -> None:
            self._fork(data.draw(st.sampled_from(sorted(self.live))))

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def free(self, data: st.DataObject) -> None:
            seq_id = data.draw(st.sampled_from(sorted(self.live)))
            self.a.free(seq_id)
            self.freed_prompts.append(self.live.pop(seq_id))
            del self.family[seq_id]

        @rule()
        def bad_calls(self) -> None:
            ghost = self.next_id + 1000
            assert_rejected(self.a, self.live, lambda: self.a.free(ghost), ghost)
            assert_rejected(self.a, self.live, lambda: self.a.append_slots(ghost, [1]), ghost)
            too_long = [1] * (self.max_len + 1)
            assert not self.a.can_allocate(too_long)
            assert_rejected(self.a, self.live, lambda: self.a.allocate(ghost, too_long), self.max_len + 1)
            for seq_id, (_, tokens) in list(self.live.items())[:1]:
                assert_rejected(self.a, self.live, lambda: self.a.allocate(seq_id, [1]), seq_id)
                too_many = [1] * (self.max_len - len(tokens) + 1)
                assert not self.a.can_append(seq_id, len(too_many))
                assert_rejected(self.a, self.live, lambda: self.a.append_slots(seq_id, too_many), seq_id)

        @invariant()
        def consistent(self) -> None:
            if not hasattr(self, "a"):
                return
            check_consistency(self.a, {s: tokens for s, (_, tokens) in self.live.items()})
            assert self.a.stats().prefix_hits == self.hits

        @invariant()
        def contents_survive(self) -> None:
            for seq_id, (extra, tokens) in getattr(self, "live", {}).items():
                read = self.kv.read(self.a.slot_mapping(seq_id, 0, len(tokens)))
                assert read == token_contents(extra, tokens), f"sequence {seq_id} reads KV that is not its own"

        @invariant()
        def sharing_only_by_fork_or_prefix(self) -> None:
            owners: dict[int, list[tuple[int, int]]] = {}  # block -> (seq, index in its table)
            for seq_id in getattr(self, "live", {}):
                for i, block in enumerate(self.a.block_table(seq_id)):
                    owners.setdefault(block, []).append((seq_id, i))
            for block, held in owners.items():
                if len(held) == 1:
                    continue
                assert shares_blocks_on_fork or self.prefix_caching, f"block {block} shared by {held}"
                if len({self.family[s] for s, _ in held}) > 1:
                    assert self.prefix_caching, f"block {block} shared across requests {held} without prefix caching"
                    assert len({i for _, i in held}) == 1, f"prefix block {block} at different positions: {held}"
                    full = all(len(self.live[s][1]) >= (i + 1) * self.bs for s, i in held)
                    assert full, f"block {block} shared across requests {held} is not a full prefix block"

    AllocatorMachine.__name__ = AllocatorMachine.__qualname__ = "AllocatorMachine"
    return AllocatorMachine
