"""The continuous-batching scheduler: which tokens of which sequences run in the next step.

Every step has one token budget (``max_num_batched_tokens``) shared by decodes and prefills:

1. Running sequences first: decodes (one token each), then prompts still being prefilled (the
   next chunk), each group oldest first. When the allocator has no block for one of them, the
   *newest* running sequence not yet scheduled in this step is preempted (its blocks freed, back at
   the front of the waiting queue; it is computed again later, mostly from the prefix cache) until
   the step fits.
2. Then, if nobody was preempted, waiting sequences in arrival order, while budget, seats
   (``max_num_seqs``, counting the ``n`` completions of a request) and blocks last. A prompt longer
   than the remaining budget is prefilled in chunks over several steps; prompt tokens found in the
   prefix cache count as computed and use no budget.

With speculative decoding, a decode the speculator proposes ``k`` tokens for runs ``1 + k`` query
tokens (the proposals are scored in the same forward), all counted in the budget; the proposals'
KV goes to lookahead slots the allocator holds for the step (none are taken when the pool is short:
the sequence then decodes one token, and nobody is preempted for a proposal).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs

from ..config import SchedulerConfig
from ..kv_cache.allocator import BlockAllocator, BlockCopy, KVCacheError
from .block_owners import BlockOwners
from .sequence import Sequence, SequenceStatus


@attrs.define
class ScheduledSequence:
    """One sequence's share of a step: tokens ``start : start + num_new_tokens`` are computed."""

    seq: Sequence
    """The sequence."""
    start: int
    """Tokens already in the cache (the step's ``context_lens`` entry)."""
    num_new_tokens: int
    """Tokens of the sequence computed in this step."""
    draft: list[int] = attrs.field(factory=list)
    """Speculative decoding: proposed tokens scored after them in the same forward (their KV goes to
    lookahead slots; only those the target accepts become the sequence's)."""


@attrs.define
class SchedulerOutput:
    """What :meth:`Scheduler.schedule` decided for one step."""

    scheduled: list[ScheduledSequence] = attrs.field(factory=list)
    """Sequences to run, in batch order."""
    block_copies: list[BlockCopy] = attrs.field(factory=list)
    """KV blocks to copy before the step (copy-on-write of shared blocks)."""
    preempted: list[Sequence] = attrs.field(factory=list)
    """Sequences that lost their blocks this step (they wait to be recomputed)."""
    ended: list[Sequence] = attrs.field(factory=list)
    """Sequences the scheduler finished itself (see :meth:`Scheduler.schedule`), already freed."""
    failed: list[tuple[Sequence, str]] = attrs.field(factory=list)
    """Sequences that can never run, with the reason; not allocated."""
    finished_seq_ids: tuple[int, ...] = ()
    """Ids of sequences that ended or were preempted since the previous batch (for adapters' state)."""

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.scheduled


class Scheduler:
    """Waiting and running queues over one block allocator."""

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, max_loras: int | None = None) -> None:
        self.config = config
        """Batch limits."""
        self.max_loras = max_loras
        """Most distinct LoRA adapters among the running sequences (None: no limit); a waiting
        sequence of another adapter waits, and later ones of running adapters go ahead of it."""
        self.allocator = allocator
        """Where the KV blocks come from."""
        self.owners = BlockOwners(allocator)
        """Which blocks the live sequences hold, as handed out: an allocator handing out a held block
        as new fails loudly instead of changing another request's output."""
        self.waiting: deque[Sequence] = deque()
        """Sequences without blocks, in the order they will be admitted."""
        self.running: list[Sequence] = []
        """Sequences holding blocks, oldest first (preemption takes from the end)."""
        self.num_preemptions = 0
        """Sequences preempted so far (each is recomputed later)."""
        self.held: set[int] = set()
        """Ids of sequences that sit out the next step, keeping their blocks: their structured-output
        grammar is still computing the mask of their next token (set by the engine before each step)."""
        self.speculator: Any = None
        """Speculative decoding's :class:`~modelrunner.spec_decode.Speculator` (None: off): decoding
        sequences it proposes for get ``k`` more query tokens, budgeted like any other."""
        self._finished_ids: list[int] = []

    # -- queues ----------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Track a sequence that already holds blocks (a forked completion) as the newest running one."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence: mark it finished and free its blocks (it leaves the queues on the next
        :meth:`schedule`, or at once when it was waiting)."""
        was = seq.status
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if was is SequenceStatus.RUNNING:
            self.allocator.free(seq.seq_id)
            self.owners.freed(seq.seq_id)
            self._finished_ids.append(seq.seq_id)
        elif was is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass  # a fork that was never queued

    def drop_finished(self) -> None:
        """Forget finished sequences in the running list."""
        if any(s.status is not SequenceStatus.RUNNING for s in self.running):
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.allocator.free(victim.seq_id)
        self.owners.freed(victim.seq_id)
        victim.reset_for_recompute()
        self.waiting.appendleft(victim)
        self._finished_ids.append(victim.seq_id)
        out.preempted.append(victim)
        self.num_preemptions += 1

    def _seats(self, seq: Sequence) -> int:
        return 1 if seq.request.forked else seq.request.params.n

    # -- the step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick the next step's tokens (see the module docstring).

        A running sequence that cannot get a block even when it is the only one left has filled
        the whole KV cache: it ends with ``finish_reason="length"`` (in ``ended``). A waiting one
        that cannot be allocated while nothing else holds blocks never will: it is ``failed``.
        """
        self.drop_finished()
        out = SchedulerOutput()
        alloc = self.allocator
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        running = self.running

        # Decodes first, so a long prompt being prefilled in chunks never stalls the others.
        held = self.held
        decodes = [s for s in running if len(s.token_ids) - s.num_computed_tokens == 1 and s.seq_id not in held]
        prefills = [s for s in running if len(s.token_ids) - s.num_computed_tokens > 1 and s.seq_id not in held]
        scheduled_ids: set[int] = set()
        drafted = [s for s in decodes if s.request.pooling is None]  # an embedding request's last prompt token
        drafts = self.speculator.propose(drafted, alloc.max_model_len) if self.speculator and drafted else {}
        for seq in decodes + prefills:
            if budget == 0 or len(out.scheduled) >= max_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an older sequence in this loop
            start = seq.num_computed_tokens
            n = min(len(seq.token_ids) - start, budget)
            while not alloc.can_append(seq.seq_id, n):
                victim = next((s for s in reversed(running) if s is not seq and s.seq_id not in scheduled_ids), None)
                if victim is None:
                    break
                self._preempt(victim, out)
            if not alloc.can_append(seq.seq_id, n):
                if len(running) == 1:  # alone and still no room: the cache is full of it
                    running.remove(seq)
                    self.finish(seq, "length")
                    out.ended.append(seq)
                else:
                    self._preempt(seq, out)
                continue
            copies = alloc.append_slots(seq.seq_id, seq.token_ids[start:start + n])
            self.owners.appended(seq.seq_id, start + n, copies)
            out.block_copies += copies
            draft = drafts.get(seq.seq_id, [])[:budget - n]
            if draft and alloc.reserve_lookahead(seq.seq_id, len(draft)):
                self.owners.appended(seq.seq_id, start + n + len(draft), [])
            else:
                draft = []
            out.scheduled.append(ScheduledSequence(seq, start, n, draft))
            scheduled_ids.add(seq.seq_id)
            budget -= n + len(draft)

        seats = sum(self._seats(s) for s in running)
        adapters = {s.request.lora_int_id for s in running} - {0}
        held_back: list[Sequence] = []  # waiting for an adapter slot (max_loras), kept in order
        while self.waiting and budget > 0 and not out.preempted and len(out.scheduled) < max_seqs:
            seq = self.waiting[0]
            lora_id = seq.request.lora_int_id
            if seq.seq_id in held or (lora_id and lora_id not in adapters and self.max_loras is not None
                                      and len(adapters) >= self.max_loras):
                held_back.append(self.waiting.popleft())
                continue
            if seats + self._seats(seq) > max_seqs:
                break
            tokens = seq.token_ids
            extra_keys = seq.request.extra_keys
            # The first chunk starts after the cached prefix, however many chunks that prefix spans.
            cached = alloc.cached_prefix_len(tokens, extra_keys) if len(tokens) > budget else 0
            chunk = tokens[:cached + budget] if len(tokens) > cached + budget else tokens
            if len(chunk) < len(tokens) and getattr(seq.request.pooling, "whole_prompt", False):
                break  # an encoder computes a prompt in one step: it waits for a step with room for all of it
            if not alloc.can_allocate(chunk, extra_keys):
                if running:
                    break  # blocks come back as running sequences finish
                self.waiting.popleft()
                out.failed.append((seq, self._too_big(seq, len(chunk))))
                continue
            try:
                hit = alloc.allocate(seq.seq_id, chunk, extra_keys)
            except KVCacheError as exc:
                self.waiting.popleft()
                out.failed.append((seq, str(exc)))
                continue
            self.waiting.popleft()
            self.owners.allocated(seq.seq_id, hit)
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = max(seq.num_cached_tokens, hit)
            seq.num_computed_tokens = hit
            seq.status = SequenceStatus.RUNNING
            running.append(seq)
            seats += self._seats(seq)
            if lora_id:
                adapters.add(lora_id)
            n = len(chunk) - hit
            out.scheduled.append(ScheduledSequence(seq, hit, n))
            budget -= n

        self.waiting.extendleft(reversed(held_back))
        out.finished_seq_ids = tuple(self._finished_ids)
        self._finished_ids.clear()
        return out

    def _too_big(self, seq: Sequence, num_tokens: int) -> str:
        alloc = self.allocator
        return (
            f"request {seq.request.request_id!r} needs KV-cache slots for {num_tokens} tokens but the "
            f"whole cache holds {alloc.num_blocks * alloc.block_size} ({alloc.num_blocks} blocks of "
            f"{alloc.block_size}); raise kv_cache_memory or shorten the prompt"
        )
