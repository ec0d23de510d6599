"""The speculator the engine builds when ``speculative_config`` is set: who speculates, how many tokens,
and the counts.

A decoding sequence speculates unless it uses a logits processor (``logit_bias``, penalties,
``bad_words``, ``min_tokens``, named processors …), whose per-token state the verification does not
replay: those decode one token per step as usual, in the same batch. A structured-output grammar
does speculate: the engine masks each verified position by the grammar's state there, walking its
matcher over the draft and rolling it back (unless the grammar is slow to mask: then it does not).
How many tokens a sequence is offered adapts to how many it had accepted: all accepted → one more
(up to ``num_speculative_tokens``), some → one more than accepted, none → half; after three
proposals in a row with nothing accepted the sequence stops speculating for a while (2, 4, 8 … up
to 64 steps), so text with nothing to copy runs at plain speed.

Whether speculation pays also depends on the machine and the batch: a verification's extra query
tokens cost little where a step is bound by reading the weights (a few sequences) and as much as
they save, or more, where it is bound by arithmetic (large batches on a CPU), where they also slow
the steps of every sequence beside them. So the speculator measures, per batch size (powers of two
of the decoding sequences), the seconds per token of the slower quarter of the sequences, in steps
with and without drafts (the fastest of the latest few of each), and proposes nothing at a batch
size where drafting has been slower; there it tries a drafting step again every :data:`_REPROBE`
steps, in case the text has changed (``disable_by_batch_size="auto"``, the default; an integer is
vLLM's fixed limit, None turns it off).

The proposer is a plugin, and misbehaving is contained here: it sees each sequence's tokens as a
tuple (it cannot change what the engine generates from); a proposal is read up to the tokens asked
for (an endless iterator costs nothing more); garbage ends a proposal; a raised exception costs
that step its drafts; and each call runs in a thread of its own, waited for at most
``$MODELRUNNER_PROPOSER_TIMEOUT`` seconds (:mod:`.bounded`): a proposer that does not return by
then turns speculative decoding off for the engine's life, logged as an error naming it, and
every request goes on without drafts.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as Seq
from typing import Any

import attrs
import numpy as np

from modelrunner.api import ProposalRequest, Proposer, ProposerContext, SpecCounters

from .bounded import BoundedCalls, ProposerTimeoutError, proposer_timeout

logger = logging.getLogger(__name__)

_MAX_PAUSE = 64
"""Most decode steps a sequence sits out after repeated fruitless proposals."""


@attrs.define
class SpecState:
    """One sequence's speculation state."""

    k: int
    """Tokens it is offered next (adapts to its acceptance)."""
    misses: int = 0
    """Proposals in a row of which nothing was accepted."""
    pause: int = 0
    """Decode steps left before it speculates again."""


_EXPLORE = 4
"""Steps of each kind (with drafts, without) measured at a batch size before the faster one is kept."""
_REPROBE = 64
"""At a batch size where drafting was slower, one step in this many drafts again (to measure anew)."""
_WINDOW = 8
"""Latest measurements of each kind kept; their fastest are compared. Noise on a step only adds
time (a graph being recorded, another process on the cores), which a mean or even a median of a
few steps would carry for long."""


@attrs.define
class StepCost:
    """Measured seconds per emitted token at one batch size, of steps with and without drafts."""

    drafted: list[float] = attrs.field(factory=list)
    """Latest steps with drafts (at most :data:`_WINDOW`)."""
    plain: list[float] = attrs.field(factory=list)
    """Latest steps without."""
    steps: int = 0
    """Steps asked about at this batch size."""

    @property
    def explored(self) -> bool:
        """Whether both kinds of step have been measured :data:`_EXPLORE` times."""
        return len(self.drafted) >= _EXPLORE and len(self.plain) >= _EXPLORE

    def drafting(self) -> bool:
        """Whether the next step at this batch size should draft."""
        self.steps += 1
        if not self.explored:
            return len(self.drafted) <= len(self.plain)  # measure both, alternating
        return self.pays() or self.steps % _REPROBE == 0

    def pays(self) -> bool:
        """Whether steps with drafts have been as fast per emitted token as steps without (True
        until both are measured)."""
        return not self.explored or min(self.drafted) <= min(self.plain)

    def observe(self, drafted: bool, seconds_per_token: float) -> None:
        """Add one step's measurement."""
        kept = self.drafted if drafted else self.plain
        kept.append(seconds_per_token)
        del kept[:-_WINDOW]


class Speculator:
    """Asks the proposer for each step's drafts and keeps per-sequence state and the counts.

    :param config: the ``speculative_config``.
    :param proposer: the proposer chosen by ``config.method``.
    :param vocab_size: the target's vocabulary size (proposals must lie below it).
    """

    def __init__(self, config: Any, proposer: Proposer, vocab_size: int,
                 timeout_s: float | None = None) -> None:
        self.config = config
        """The ``speculative_config``."""
        self.proposer = proposer
        """Where the drafts come from."""
        self.calls = BoundedCalls(proposer.name, proposer_timeout() if timeout_s is None else timeout_s or None)
        """Runs the proposer's calls, each bounded (``timeout_s``, default ``$MODELRUNNER_PROPOSER_TIMEOUT``;
        0: no bound)."""
        self.disabled: str | None = None
        """Why speculative decoding is off for good (a proposer call did not return in time); None: on."""
        self.excluded: Any = None
        """A predicate on a sequence: True where it must not speculate this step (the engine's: a slow
        structured-output grammar, whose masks over the drafts would be computed within the step)."""
        self.vocab_size = vocab_size
        """Token ids at or above this are cut from proposals."""
        self.counters = SpecCounters()
        """Totals since the engine started."""
        self.costs: dict[int, StepCost] = {}
        """Batch-size bucket (``bit_length`` of the decoding sequences) → measured step costs."""
        self._states: dict[int, SpecState] = {}

    @classmethod
    def create(cls, config: Any, executor: Any, allocator: Any, vocab_size: int, tokenizer: Any) -> Speculator:
        """The speculator of ``config.speculative`` for an engine on ``executor`` and ``allocator``.

        :raises ValueError: the model keeps its own cache, the allocator cannot hold lookahead slots, or
            the method names no installed proposer (the message lists those that are).
        """
        spec = config.speculative
        if executor.kv_cache_spec is None:
            raise ValueError("speculative_config: this model keeps its own cache, which cannot take back rejected "
                             "tokens; speculative decoding needs a model on the paged KV cache")
        if not allocator.supports_lookahead:
            raise ValueError(f"speculative_config: KV allocator {config.cache.kv_allocator!r} cannot reserve "
                             "lookahead slots for proposed tokens (supports_lookahead is False); use "
                             "kv_allocator='paged'")
        plugins = executor.plugins
        names = plugins.registry.names("proposers")
        try:
            proposer_class = plugins.proposer_class(spec.method)
        except Exception as exc:  # noqa: BLE001 - an unknown or conflicting name: say which exist
            raise ValueError(f"speculative_config: unknown method {spec.method!r}; installed proposers: "
                             f"{', '.join(names) or '(none)'} ({exc})") from None
        proposer = proposer_class(ProposerContext(spec, vocab_size, config, plugins, tokenizer))
        return cls(spec, proposer, vocab_size)

    def eligible(self, seq: Any) -> bool:
        """Whether ``seq`` may speculate (see the module docstring for who does not)."""
        return not seq.request.processor_states and not (self.excluded is not None and self.excluded(seq))

    def propose(self, seqs: Seq[Any], max_model_len: int) -> dict[int, list[int]]:
        """Drafts for the decoding sequences ``seqs`` (by seq id); sequences absent speculate not this step."""
        if self.disabled is not None:
            return {}
        requests: list[ProposalRequest] = []
        limit = self.config.disable_by_batch_size
        if limit == "auto":
            if not self.costs.setdefault(len(seqs).bit_length(), StepCost()).drafting():
                return {}
        elif limit is not None and len(seqs) >= limit:
            return {}
        for seq in seqs:
            if not self.eligible(seq):
                continue
            state = self._states.get(seq.seq_id)
            if state is None:
                state = self._states[seq.seq_id] = SpecState(k=self.config.num_speculative_tokens)
            if state.pause:
                state.pause -= 1
                continue
            params = seq.params
            room = min(state.k, max_model_len - len(seq.token_ids),
                       params.max_tokens - seq.num_output_tokens - 1 if params.max_tokens is not None else state.k)
            if room > 0:  # a tuple: the proposer cannot change the sequence it reads
                requests.append(ProposalRequest(seq.seq_id, tuple(seq.token_ids), room))
        if not requests:
            return {}
        try:
            proposals = self.calls.call(lambda: self._read(self.proposer.propose(tuple(requests)), requests), "propose")
        except ProposerTimeoutError as exc:
            self._disable(exc)
            return {}
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a broken proposer slows, never fails, requests
            self.counters.proposer_errors += 1
            logger.warning("proposer %r failed (%s: %s); this step does not speculate", self.proposer.name,
                           type(exc).__name__, exc)
            return {}
        return {request.seq_id: clean for request, clean in zip(requests, proposals) if clean}

    def _read(self, proposals: Any, requests: list[ProposalRequest]) -> list[list[int]]:
        """The valid prefix of each proposal, at most the tokens asked for: read in the proposer's thread,
        so an endless iterator is cut there (and a slow one is bounded with the call).

        :raises ValueError: not one proposal per request.
        """
        got = list(itertools.islice(iter(proposals), len(requests) + 1))
        if len(got) != len(requests):
            more = "more than " if len(got) > len(requests) else ""
            raise ValueError(f"returned {more}{len(got)} proposals for {len(requests)} sequences")
        vocab = self.vocab_size
        out: list[list[int]] = []
        for request, proposal in zip(requests, got):
            clean: list[int] = []
            try:
                tokens = list(itertools.islice(iter(proposal), request.num_tokens + 1))
            except TypeError:
                tokens = []  # not a list of tokens at all
            if len(tokens) > request.num_tokens:
                self._truncated(request.num_tokens)
                del tokens[request.num_tokens:]
            for token in tokens:
                if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
                    break  # garbage from here on: keep what came before
                if not 0 <= token < vocab:
                    self._out_of_vocab(int(token))
                    break
                clean.append(int(token))
            out.append(clean)
        return out

    def _out_of_vocab(self, token: int) -> None:
        self.counters.proposals_out_of_vocab += 1
        if self.counters.proposals_out_of_vocab == 1:
            logger.warning("proposer %r proposed token id %d, outside the target's vocabulary (0 … %d); proposals "
                           "are cut there and counted in stats()['speculative']['proposals_out_of_vocab'] (reported "
                           "once)", self.proposer.name, token, self.vocab_size - 1)

    def _truncated(self, asked: int) -> None:
        self.counters.proposals_truncated += 1
        if self.counters.proposals_truncated == 1:
            logger.warning("proposer %r proposed more than the %d tokens asked for; proposals are cut there "
                           "(reported once)", self.proposer.name, asked)

    def _disable(self, error: ProposerTimeoutError) -> None:
        self.counters.proposer_timeouts += 1
        self.disabled = f"{error}; speculative decoding is off from then on"
        logger.error("%s: speculative decoding is off from now on (requests go on without drafts; restart to turn it "
                     "back on)", error)

    def observe(self, drafted: bool, seconds: float, emitted: Seq[int]) -> None:
        """One decode step's cost (steps that also prefill are not reported): with drafts or not, it
        took ``seconds`` and appended ``emitted[i]`` tokens to its i-th sequence. Measured is the time
        per token of the slower quarter of the sequences: drafting must pay for most of the batch, not
        only for the sequences whose drafts are accepted while it slows every other one's steps."""
        if not emitted or self.config.disable_by_batch_size != "auto":
            return
        slow = sorted(emitted)[(len(emitted) - 1) // 4]
        if slow:
            self.costs.setdefault(len(emitted).bit_length(), StepCost()).observe(drafted, seconds / slow)

    def record(self, seq: Any, num_proposed: int, num_accepted: int, num_emitted: int) -> None:
        """Count one verification of ``seq`` and adapt its ``k``."""
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_proposed
        counters.num_accepted_tokens += num_accepted
        counters.num_emitted_tokens += num_emitted
        metrics = seq.request.metrics
        metrics.spec_num_drafts += 1
        metrics.spec_num_draft_tokens += num_proposed
        metrics.spec_num_accepted_tokens += num_accepted
        state = self._states.get(seq.seq_id)
        if state is None:
            return
        limit = self.config.num_speculative_tokens
        if num_accepted == num_proposed:
            state.k, state.misses = min(limit, state.k + 1), 0
        elif num_accepted:
            state.k, state.misses = min(limit, num_accepted + 1), 0
        else:
            state.k = max(1, state.k // 2)
            state.misses += 1
            if state.misses >= 3:
                state.pause = min(_MAX_PAUSE, 2 ** (state.misses - 2))

    def forget(self, seq_ids: Seq[int]) -> None:
        """Sequences that ended or were preempted: drop their state here and in the proposer."""
        if not seq_ids:
            return
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)
        if self.disabled is not None:
            return  # its last call may still run: never call it again
        try:
            self.calls.call(lambda: self.proposer.forget(tuple(seq_ids)), "forget")
        except ProposerTimeoutError as exc:
            self._disable(exc)
        except (Exception, SystemExit) as exc:  # noqa: BLE001
            logger.warning("proposer %r failed to forget sequences (%s: %s)", self.proposer.name,
                           type(exc).__name__, exc)

    def stats(self) -> dict[str, Any]:
        """The counts, the acceptance rate and the mean accepted length, plus the proposer's own."""
        c = self.counters
        out: dict[str, Any] = {"method": self.config.method,
                               "num_speculative_tokens": self.config.num_speculative_tokens, **attrs.asdict(c)}
        out["acceptance_rate"] = c.num_accepted_tokens / c.num_draft_tokens if c.num_draft_tokens else 0.0
        out["mean_acceptance_length"] = c.num_emitted_tokens / c.num_drafts if c.num_drafts else 0.0
        out["step_costs"] = {f"{2 ** (b - 1)}-{2 ** b - 1} seqs": {
            "drafted_ms_per_token": round(min(c.drafted) * 1e3, 3) if c.drafted else None,
            "plain_ms_per_token": round(min(c.plain) * 1e3, 3) if c.plain else None,
            "drafting": c.pays()} for b, c in sorted(self.costs.items())}
        if self.disabled is not None:
            out["disabled"] = self.disabled
            return out  # the proposer may still run in its thread: not asked
        out.update(self.proposer.stats())
        return out
