"""The engine's constrained sequences on their way through a step: waiting for their grammar to
compile, then for their first mask, then running with a :class:`~.manager.GrammarCursor` whose mask
thread works between steps.

The engine calls, each step: :meth:`ConstrainedSequences.admit_compiled` and
:meth:`ConstrainedSequences.collect_masks` before scheduling, :meth:`ConstrainedSequences.note` for
each token appended to a constrained sequence, and :meth:`ConstrainedSequences.advance` after the
step; :meth:`ConstrainedSequences.release` when a request ends.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .manager import IDLE_WAIT_S, GrammarCursor, StructuredOutputManager

if TYPE_CHECKING:  # annotations only: the engine, above this package, hands these in
    from ..engine.scheduler import Scheduler
    from ..engine.sequence import Request, Sequence


class ConstrainedSequences:
    """The grammar state of the engine's constrained sequences (``structured_outputs`` requests).

    :param manager: the grammar backends and their compile and mask threads.
    :param scheduler: the engine's scheduler: sequences join it once their first mask is ready, and
        sit out the steps while their next mask is being computed (its ``held`` set).
    """

    def __init__(self, manager: StructuredOutputManager, scheduler: Scheduler) -> None:
        self.manager = manager
        """The grammar backends, compiled grammars and the step's token bitmask."""
        self.scheduler = scheduler
        """The engine's scheduler."""
        self.compiling: list[Sequence] = []
        """Sequences waiting for their grammar to compile, in arrival order."""
        self.starting: list[Sequence] = []
        """Compiled, waiting for their first mask."""
        self.cursors: dict[int, GrammarCursor] = {}
        """Sequence id → its grammar's cursor."""
        self._appended: dict[int, list[int]] = {}  # seq id → tokens appended this step, for its cursor

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``: it is scheduled once its grammar compiled and its first mask is ready."""
        self.compiling.append(seq)

    def cursor(self, seq: Sequence) -> GrammarCursor:
        """``seq``'s cursor (it has a grammar)."""
        return self.cursors[seq.seq_id]

    def is_slow(self, seq: Sequence) -> bool:
        """Whether ``seq``'s grammar is slow to mask (it does not speculate: verifying drafts would
        compute masks within the step)."""
        cursor = self.cursors.get(seq.seq_id)
        return cursor is not None and cursor.slow

    def admit_compiled(self) -> list[tuple[Request, str]]:
        """Start a grammar cursor (a matcher, its first mask being computed) for each sequence whose
        grammar compiled; return the requests whose grammar failed to compile, took longer than
        ``compile_timeout_s`` (or waited that long for a thread), or could not start a matcher, with
        why. With nothing else to run, wait (briefly) for a compilation rather than spin."""
        if not self.compiling:
            return []
        manager, scheduler = self.manager, self.scheduler
        if not scheduler.waiting and not scheduler.running and not self.starting:
            manager.wait([s.request.grammar for s in self.compiling if not s.is_finished], timeout=IDLE_WAIT_S)
        waiting: list[Sequence] = []
        failed: dict[str, tuple[Request, str]] = {}
        for seq in self.compiling:
            grammar = seq.request.grammar
            if seq.is_finished:
                continue  # aborted while compiling
            if not grammar.ready:
                problem = manager.overdue(grammar)
                if problem is None:
                    waiting.append(seq)
                else:
                    failed[seq.request.request_id] = (seq.request, str(problem))
                continue
            reason = grammar.error
            if reason is None:
                try:
                    self.cursors[seq.seq_id] = cursor = manager.start(grammar)
                except Exception as exc:  # noqa: BLE001 - a backend bug fails its request only
                    reason = f"grammar backend {grammar.backend.name!r} could not start a matcher: " \
                             f"{type(exc).__name__}: {exc}"
                else:
                    cursor.owner, seq.grammar = seq, cursor.matcher
                    self.starting.append(seq)
            if reason is not None:
                failed[seq.request.request_id] = (seq.request, reason)
        self.compiling = waiting
        return list(failed.values())

    def collect_masks(self, changed: dict[str, Request], outputs_pending: bool) -> list[tuple[Request, str]]:
        """Take in the cursors' finished mask work (waiting a moment for fast grammars when the engine
        has nothing else to do — no other sequence, ``outputs_pending`` False; see
        :meth:`StructuredOutputManager.collect`): queue the sequences whose first mask is ready, end
        those whose grammar is complete (``stop``, into ``changed``), hold the rest out of this step
        (the scheduler's ``held``), and return the requests that fail (a backend failure, or a mask
        past ``mask_timeout_s``), with why."""
        if not self.cursors:
            return []
        for seq_id in [i for i, c in self.cursors.items() if c.owner.is_finished]:
            del self.cursors[seq_id]
        pending = {i for i, c in self.cursors.items() if c.job is not None}
        scheduler = self.scheduler
        idle = all(s.seq_id in pending for s in scheduler.running) and \
            all(s.seq_id in pending for s in scheduler.waiting) and not outputs_pending
        failed: dict[str, tuple[Request, str]] = {}
        for cursor, reason in self.manager.collect(list(self.cursors.values()), idle):
            request = cursor.owner.request
            failed.setdefault(request.request_id, (request, reason))
            self.cursors.pop(cursor.owner.seq_id, None)
        for seq_id, cursor in list(self.cursors.items()):
            seq = cursor.owner
            if cursor.ready and cursor.terminated and not seq.is_finished and seq.request.request_id not in failed:
                del self.cursors[seq_id]
                scheduler.finish(seq, "stop")  # the constraint is complete: nothing but its end may follow
                if seq.request.is_finished:
                    seq.request.metrics.finished_time = time.monotonic()
                changed[seq.request.request_id] = seq.request
        starting: list[Sequence] = []
        for seq in self.starting:
            cursor = self.cursors.get(seq.seq_id)
            if cursor is None or seq.is_finished:
                continue
            if cursor.ready:
                scheduler.add(seq)
            else:
                starting.append(seq)
        self.starting = starting
        scheduler.held = {i for i, c in self.cursors.items() if c.job is not None}
        return list(failed.values())

    def note(self, seq: Sequence, token: int) -> None:
        """``token`` was appended to the constrained ``seq``: its cursor takes it after the step."""
        self._appended.setdefault(seq.seq_id, []).append(token)

    def advance(self) -> None:
        """Hand the tokens this step appended to constrained sequences to their cursors' mask threads."""
        tokens, self._appended = self._appended, {}
        for seq_id, appended in tokens.items():
            cursor = self.cursors.get(seq_id)
            if cursor is None:
                continue
            if cursor.owner.is_finished:
                del self.cursors[seq_id]
                continue
            self.manager.advance(cursor, appended)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child``, forked from ``parent`` before its first token, a cursor of its own (a fresh
        matcher is the same state)."""
        cursor = self.cursors[child.seq_id] = self.manager.fork(self.cursors[parent.seq_id])
        cursor.owner, child.grammar = child, cursor.matcher

    def release(self, request: Request) -> None:
        """Let go of a finished request's grammar now: requests and sequences refer to each other, so
        they are freed by the cycle collector, late, and a compiled grammar (hundreds of MB for a long
        enum) must not live on with them once the cache dropped it."""
        request.grammar = None
        for seq in request.seqs:
            seq.grammar = None
            self.cursors.pop(seq.seq_id, None)


__all__ = ["ConstrainedSequences"]
