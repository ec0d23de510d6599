"""The third part of an engine step: what one forward's logits do to the sequences that ran in it.

:class:`StepUpdate` takes the rows :class:`~.forward.BatchForward` returned and advances every
sequence: prompt log-probabilities, pooled requests ended with their embedding, one token chosen per
sequence that reached its last token (``n > 1`` requests forked at their first), speculative drafts
verified, stop conditions applied. A sequence either advances whole or its request fails by itself
(the engine's ``fail``); nothing is left half-advanced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import FatalError
from ..kv_cache.allocator import KVCacheError
from ..sampling.chooser import Chosen, TokenChooser, sampling_error
from ..structured_output.cursors import ConstrainedSequences
from .outputs import RequestOutput
from .pooling import EnginePooler
from .scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from .sequence import Request, Sequence
from .stop_checker import StopChecker

logger = logging.getLogger(__name__)

Fail = Callable[[Request, str, list[RequestOutput]], None]
"""The engine's way to end a request with ``finish_reason="error"`` (appending its final output)."""


class StepUpdate:
    """Advances the sequences of one step from its logits (the engine's ``schedule → forward → update``).

    :param fail: ends a request as failed; called for the request whose sampling, pooling or token
        append raised, while the rest of the batch goes on.
    :param next_seq_id: a fresh sequence id (for the completions a request with ``n > 1`` forks).
    """

    def __init__(self, scheduler: Scheduler, executor: Any, chooser: TokenChooser, stop_checker: StopChecker,
                 constrained: ConstrainedSequences, pooler: EnginePooler, speculator: Any,
                 fail: Fail, next_seq_id: Callable[[], int]) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.chooser = chooser
        self.stop_checker = stop_checker
        self.constrained = constrained
        self.pooler = pooler
        self.speculator = speculator
        self.fail = fail
        self.next_seq_id = next_seq_id
        self.shares_kv_on_fork = executor.kv_cache_spec is not None
        """Forked completions share the prompt's KV blocks (False: the model keeps its own cache)."""

    @property
    def allocator(self) -> Any:
        return self.scheduler.allocator

    def apply(self, executed: tuple[torch.Tensor, list[Any], list[ScheduledSequence]],
              changed: dict[str, Request], outputs: list[RequestOutput], started: float) -> None:
        """Advance the step's sequences from ``executed`` (logits, each row's owner, the items that ran):
        requests that changed go into ``changed``, final outputs of failed ones into ``outputs``."""
        logits, owners, scheduled = executed
        # The forward wrote these tokens' KV. From here on every sequence that reached its last
        # token either gets its next token or its request fails: none is left half-advanced.
        for item in scheduled:
            item.seq.num_computed_tokens = item.start + item.num_new_tokens
        self._finish_pooled(scheduled, changed, outputs)
        prompt_rows = [(r, o) for r, o in enumerate(owners) if not o.samples]
        self.chooser.prompt_logprobs(logits, [r for r, _ in prompt_rows],
                                     [scheduled[o.item].seq for _, o in prompt_rows],
                                     [o.position for _, o in prompt_rows])
        sampled: list[tuple[int, Sequence]] = []
        speculated: dict[int, list[int]] = {}  # scheduled item → its rows (last token, then drafts)
        for r, o in enumerate(owners):
            if o.samples:
                if scheduled[o.item].draft:
                    speculated.setdefault(o.item, []).append(r)
                else:
                    sampled.append((r, scheduled[o.item].seq))
        chosen = self._sample([r for r, _ in sampled], [seq for _, seq in sampled], logits, outputs)
        for seq, choice in chosen:
            self._append(seq, choice, changed, outputs)
        verified = [self._verify(scheduled[index], logits[rows], changed, outputs)
                    for index, rows in speculated.items()]  # tokens each appended
        if self.speculator is not None and all(item.num_new_tokens == 1 for item in scheduled):
            self.speculator.observe(bool(speculated), time.perf_counter() - started, [1] * len(chosen) + verified)

    def _finish_pooled(self, scheduled: list[ScheduledSequence], changed: dict[str, Request],
                       outputs: list[RequestOutput]) -> None:
        """End the pooling requests whose whole prompt is now computed, with their embedding."""
        for item in scheduled:
            seq, request = item.seq, item.seq.request
            if request.pooling is None or seq.is_finished or seq.num_computed_tokens < len(seq.token_ids):
                continue
            try:
                self.pooler.finish(request)
            except Exception as exc:
                self.fail(request, f"pooling failed: {type(exc).__name__}: {exc}", outputs)
                continue
            self.scheduler.finish(seq, "stop")
            request.metrics.finished_time = time.monotonic()
            changed[request.request_id] = request

    # -- sampling --------------------------------------------------------------------------------

    def _sample(self, rows: list[int], seqs: list[Sequence], logits: torch.Tensor,
                outputs: list[RequestOutput]) -> list[tuple[Sequence, Chosen]]:
        """Choose the next token of every sequence that reached its last token (forking ``n > 1``
        requests at their first token). Nothing here changes a sequence: if choosing fails for the
        whole batch, each request's rows are chosen alone (generators rewound first), and a request
        that fails again fails by itself, naming the cause."""
        targets: list[Sequence] = []
        row_of: list[int] = []
        for row, seq in zip(rows, seqs):
            if seq.is_finished:
                continue
            targets.append(seq)
            row_of.append(row)
            request = seq.request
            if not request.forked:
                if request.params.n > 1:
                    for child in self._fork(seq):
                        targets.append(child)
                        row_of.append(row)
                request.forked = True
        if not targets:
            return []
        raw = logits.index_select(0, torch.tensor(row_of, dtype=torch.long)) if row_of != list(range(len(logits))) \
            else logits
        try:
            with self.chooser.rewind_on_failure(targets):
                return list(zip(targets, self.chooser.choose(raw, targets)))
        except FatalError:
            raise
        except Exception as exc:
            logger.warning("sampling %d rows failed (%s: %s); sampling each request alone", len(targets),
                           type(exc).__name__, exc)
        chosen: list[tuple[Sequence, Chosen]] = []
        for request in dict.fromkeys(seq.request for seq in targets):
            mine = [i for i, seq in enumerate(targets) if seq.request is request]
            try:
                with self.chooser.rewind_on_failure([targets[i] for i in mine]):
                    picks = self.chooser.choose(raw[mine], [targets[i] for i in mine])
            except FatalError:
                raise
            except Exception as exc:
                self.fail(request, sampling_error(exc), outputs)
                continue
            chosen += [(targets[i], pick) for i, pick in zip(mine, picks)]
        return chosen

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Create completions 1 … n-1 sharing the parent's freshly prefilled prompt blocks."""
        children = []
        for index in range(1, parent.request.params.n):
            child = parent.fork(self.next_seq_id(), index)
            if parent.grammar is not None:
                self.constrained.fork(parent, child)
            parent.request.seqs.append(child)
            children.append(child)
            if self.shares_kv_on_fork:
                try:
                    copies = self.allocator.fork(parent.seq_id, child.seq_id)
                    self.scheduler.owners.forked(parent.seq_id, child.seq_id)
                    self.executor.copy_blocks(copies)
                    self.scheduler.add_running(child)
                    continue
                except KVCacheError:
                    pass
            # No shared KV (model keeps its own cache, or no blocks): compute the child from scratch.
            child.reset_for_recompute()
            self.scheduler.waiting.appendleft(child)
        return children

    def _append(self, seq: Sequence, choice: Chosen, changed: dict[str, Request],
               outputs: list[RequestOutput]) -> None:
        """Append one chosen token to ``seq`` (its log-probabilities, metrics, stop conditions)."""
        request = seq.request
        if seq.is_finished:
            return
        try:
            finish = self.stop_checker.append_token(seq, choice.token)
        except Exception as exc:
            self.fail(request, f"appending token {choice.token} failed: {type(exc).__name__}: {exc}", outputs)
            return
        if seq.grammar is not None and finish is None:  # its cursor accepts it after the step
            self.constrained.note(seq, choice.token)
        if choice.logprobs is not None and seq.logprobs is not None:
            seq.logprobs.append(choice.logprobs)
            seq.cumulative_logprob += choice.logprobs[choice.token].logprob
        now = time.monotonic()
        metrics = request.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        metrics.num_generated_tokens += 1
        if finish is not None:
            self.scheduler.finish(seq, *finish)
            if request.is_finished:
                metrics.finished_time = now
        changed[request.request_id] = request

    # -- speculative decoding ----------------------------------------------------------------------

    def _verify(self, item: ScheduledSequence, raw: torch.Tensor, changed: dict[str, Request],
                outputs: list[RequestOutput]) -> int:
        """Check ``item``'s drafts against the target's logits ``raw`` (its last token's row, then one per
        draft) and append what survives: the accepted drafts and one token of the target's. Greedy
        rows accept the drafts matching the argmax; sampled rows use rejection sampling, which keeps the
        target's distribution. The accepted drafts' KV, already in the lookahead slots, becomes the
        sequence's; the prefix cache sees only those. Returns the number of tokens appended."""
        seq = item.seq
        if seq.is_finished:
            return 0
        draft = item.draft
        try:
            with self.chooser.rewind_on_failure([seq]):
                tokens, entries, complete_after = self.chooser.accept(raw, seq, draft)
        except FatalError:
            raise
        except Exception as exc:
            self.fail(seq.request, sampling_error(exc), outputs)
            return 0
        accepted = len(tokens) - 1
        self.speculator.record(seq, len(draft), accepted, len(tokens))
        complete = complete_after is not None and accepted == complete_after
        if complete:  # its grammar is complete after the accepted drafts: the target's token after them is dropped
            tokens, entries = tokens[:accepted], entries[:accepted]
        if accepted:
            copies = self.allocator.append_slots(seq.seq_id, tokens[:accepted])  # into the lookahead slots
            self.scheduler.owners.appended(seq.seq_id, seq.num_computed_tokens + accepted, copies)
            if copies:  # none from the paged allocator: the slots are the sequence's alone
                self.executor.copy_blocks(copies)
            seq.num_computed_tokens += accepted
        appended = 0
        for token, entry in zip(tokens, entries):
            self._append(seq, Chosen(token, entry), changed, outputs)
            appended += 1
            if seq.is_finished:
                break  # EOS, a stop string or max_tokens inside the accepted run: the rest is dropped
        if complete and not seq.is_finished:
            self.scheduler.finish(seq, "stop")  # nothing but the constraint's end may follow
            if seq.request.is_finished:
                seq.request.metrics.finished_time = time.monotonic()
            changed[seq.request.request_id] = seq.request
        return appended

    def release_lookahead(self, out: SchedulerOutput) -> None:
        """Give back the lookahead slots of this step's drafts (the accepted ones hold tokens now), and
        let the speculator forget the sequences that ended or were preempted."""
        for item in out.scheduled:
            seq_id = item.seq.seq_id
            if item.draft and seq_id in self.allocator:
                self.allocator.release_lookahead(seq_id)
                self.scheduler.owners.trimmed(seq_id)
        ended = [item.seq.seq_id for item in out.scheduled if item.seq.is_finished]
        self.speculator.forget([*out.finished_seq_ids, *ended])
