"""Choosing tokens from a step's logits: the engine's one call for sampling.

:class:`TokenChooser` checks the model's rows, masks them by each constrained sequence's grammar,
applies the logits processors (penalties, bias, bad words, plugins), samples every row at once,
verifies speculative drafts (greedy matching or rejection sampling) and computes the log-probabilities
requests ask for — always from the model's raw logits, as vLLM does. It changes no sequence: the
engine appends what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ..layers.cpu_ops import broken_rows
from ..structured_output.manager import GrammarCursor, GrammarFailed, StructuredOutputManager
from .logprobs import Logprob, PositionLogprobs, token_logprobs
from .processors import ProcessorFailed, ProcessorPipeline, logits_problem
from .rejection import greedy_accept, rejection_sample
from .sampler import Sampler, SamplingMetadata, sampling_probs

if TYPE_CHECKING:  # annotations only: the engine, above this package, hands these in
    from ..engine.sequence import Sequence


@attrs.frozen
class Chosen:
    """What sampling decided for one logits row."""

    token: int
    """The sampled token."""
    logprobs: PositionLogprobs | None
    """Its and the top tokens' log-probabilities, when asked."""


class BrokenLogits(ValueError):
    """A request's logits cannot be sampled (NaN/inf from the model, or every token masked)."""


def sampling_error(exc: Exception) -> str:
    """The reason a request fails with when choosing its token raised ``exc``."""
    if isinstance(exc, (BrokenLogits, ProcessorFailed, GrammarFailed)):
        return str(exc)
    return f"sampling failed: {type(exc).__name__}: {exc}"


class Rewind:
    """Restores ``generators`` to their states at entry if the body raises, so a retry draws exactly
    what a run without the failure would have."""

    __slots__ = ("saved",)

    def __init__(self, generators: list[torch.Generator]) -> None:
        self.saved = [(g, g.get_state()) for g in generators]

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, value: object, tb: object) -> bool:
        if kind is not None:
            for g, state in self.saved:
                g.set_state(state)
        return False


class TokenChooser:
    """Turns logits rows into tokens (see the module's docstring).

    :param sampler: the batched sampler (its shared generator serves requests without a seed).
    :param processors: the engine's logits processors.
    :param grammars: the grammar backends (masks of constrained rows).
    :param cursor_of: a constrained sequence's grammar cursor (its next mask).
    :param vocab_size: the model's vocabulary (the logits' width).
    :param tokenizer: decodes the tokens named in log-probabilities (None: no text).
    """

    def __init__(self, sampler: Sampler, processors: ProcessorPipeline, grammars: StructuredOutputManager,
                 cursor_of: Callable[[Sequence], GrammarCursor], vocab_size: int, tokenizer: Any) -> None:
        self.sampler = sampler
        """The batched sampler."""
        self.processors = processors
        """The logits processors requests use."""
        self.grammars = grammars
        """The grammar backends."""
        self.cursor_of = cursor_of
        """A constrained sequence's grammar cursor."""
        self.vocab_size = vocab_size
        """The logits' width."""
        self.tokenizer = tokenizer
        """Decodes tokens for log-probabilities (None: no text)."""

    def choose(self, raw: torch.Tensor, seqs: list[Sequence]) -> list[Chosen]:
        """Tokens for ``raw`` logits rows (one per sequence): check them, mask constrained rows by their
        grammar, apply the logits processors, sample, and compute the asked log-probabilities from the
        raw logits.

        :raises BrokenLogits: a row of the wrong shape, NaN or +inf, or with every token excluded.
        """
        self.check(raw, seqs)
        # Without processors or grammars the rows are sampled as they are (checked above: not all -inf).
        constrained = any(seq.grammar is not None for seq in seqs)
        if constrained or any(seq.request.processor_states for seq in seqs):
            logits = raw.clone()
            if constrained:  # the grammars' masks first (computed by their cursors), one bitmask for the batch
                self.grammars.apply_masks(logits, [None if s.grammar is None else self.cursor_of(s) for s in seqs])
            if any(seq.request.processor_states for seq in seqs):
                logits = self.processors.apply(logits, seqs)
            masked = torch.isneginf(logits).all(1)
            if bool(masked.any()):
                seq = seqs[int(masked.nonzero()[0])]
                raise BrokenLogits(f"every token is excluded for request {seq.request.request_id!r} (by "
                                   "allowed_token_ids, bad_words, logit_bias, a logits processor or its "
                                   "structured_outputs grammar); nothing can be sampled")
        else:
            logits = raw
        params = [s.params for s in seqs]
        metadata = SamplingMetadata.from_rows([p.temperature for p in params], [p.top_k for p in params],
                                              [p.top_p for p in params], [s.generator for s in seqs],
                                              [p.min_p for p in params])
        tokens = self.sampler(logits, metadata)
        asking = [i for i, p in enumerate(params) if p.logprobs is not None]
        found: dict[int, PositionLogprobs] = {}
        if asking:
            k = max(params[i].logprobs for i in asking)
            index = torch.tensor(asking, dtype=torch.long)
            picked, rank, top_ids, top_lps = token_logprobs(raw[index], tokens[index], k)
            for j, i in enumerate(asking):
                found[i] = self.logprob_entry(int(tokens[i]), float(picked[j]), int(rank[j]),
                                              top_ids[j, :params[i].logprobs].tolist(),
                                              top_lps[j, :params[i].logprobs].tolist())
        return [Chosen(int(t), found.get(i)) for i, t in enumerate(tokens.tolist())]

    def accept(self, raw: torch.Tensor, seq: Sequence, draft: list[int]
               ) -> tuple[list[int], list[PositionLogprobs | None], int | None]:
        """Verify ``seq``'s ``draft`` against the target's rows ``raw`` (its last token's row, then one
        per draft token): greedy rows accept the drafts matching the argmax, sampled rows use rejection
        sampling, which keeps the target's distribution.

        :returns: the tokens to append (the accepted drafts, then one of the target's), with their
            log-probabilities when asked, and after how many draft tokens the sequence's grammar is
            complete (None: not within the draft).
        """
        self.check(raw, [seq] * len(raw))
        logits = raw
        complete_after = None
        if seq.grammar is not None:  # log-probabilities stay the model's own, as in plain decoding
            logits, draft, complete = self._grammar_masked(raw, seq, draft)
            complete_after = len(draft) if complete else None
        rows = len(logits)
        params = seq.params
        metadata = SamplingMetadata.from_rows([params.temperature] * rows, [params.top_k] * rows,
                                              [params.top_p] * rows, [seq.generator] * rows, [params.min_p] * rows)
        if metadata.all_greedy:
            tokens = greedy_accept(self.sampler(logits, metadata).tolist(), draft)
        else:
            generator = seq.generator if seq.generator is not None else self.sampler.generator
            tokens = rejection_sample(sampling_probs(logits, metadata), draft, generator)
        if params.logprobs is None:
            return tokens, [None] * len(tokens), complete_after
        picked, rank, top_ids, top_lps = token_logprobs(raw[:len(tokens)], torch.tensor(tokens), params.logprobs)
        return tokens, [self.logprob_entry(t, float(picked[j]), int(rank[j]), top_ids[j].tolist(),
                                           top_lps[j].tolist()) for j, t in enumerate(tokens)], complete_after

    def _grammar_masked(self, raw: torch.Tensor, seq: Sequence,
                        draft: list[int]) -> tuple[torch.Tensor, list[int], bool]:
        """A constrained sequence's verification rows, each masked by its grammar at that position: the
        matcher walks the draft (a draft token its mask refuses ends the draft there, and the rows
        after it are dropped; so does the grammar's completion, which the returned flag says), then
        is rolled back to where it was; the accepted tokens advance its cursor after the step."""
        matcher, grammar = seq.grammar, seq.request.grammar
        logits = raw.clone()
        walked = 0
        complete = False
        try:
            for j in range(len(draft) + 1):
                if j and matcher.is_terminated():  # complete after draft[:j]: the row after it is never used
                    draft, complete = draft[:j], True
                    break
                if j == 0:  # the cursor's ready mask; the positions after it are filled now (fast grammars only)
                    self.grammars.apply_masks(logits[:1], [self.cursor_of(seq)])
                else:
                    self.grammars.apply_bitmasks(logits[j:j + 1], [matcher], [grammar])
                if j == len(draft) or bool(torch.isneginf(logits[j, draft[j]])):
                    draft = draft[:j]
                    break
                if not matcher.accept_tokens([draft[j]]):
                    raise GrammarFailed(f"grammar backend {grammar.backend.name!r} refused token {draft[j]}, "
                                        "which its own mask allowed")
                walked += 1
        finally:
            if walked:
                matcher.rollback(walked)
        return logits[:len(draft) + 1], draft, complete

    def prompt_logprobs(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence],
                        positions: list[int]) -> None:
        """Record the log-probabilities of prompt tokens: row ``rows[j]`` of ``logits`` predicts token
        ``positions[j] + 1`` of ``seqs[j]``, which keeps its ``prompt_logprobs`` top tokens there."""
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long)
        targets = torch.tensor([seq.token_ids[p + 1] for seq, p in zip(seqs, positions)], dtype=torch.long)
        k = max(seq.params.prompt_logprobs for seq in seqs)
        picked, rank, top_ids, top_lps = token_logprobs(logits.index_select(0, index), targets, k)
        for j, (seq, position) in enumerate(zip(seqs, positions)):
            n = seq.params.prompt_logprobs
            seq.request.prompt_logprobs[position + 1] = self.logprob_entry(
                int(targets[j]), float(picked[j]), int(rank[j]), top_ids[j, :n].tolist(), top_lps[j, :n].tolist())

    def check(self, raw: torch.Tensor, seqs: list[Sequence]) -> None:
        """Raise :class:`BrokenLogits` for logits of the wrong shape, or with NaN / +inf / all -inf rows."""
        problem = logits_problem(raw, (len(seqs), self.vocab_size))
        if problem is not None:
            raise BrokenLogits(f"the model returned {problem}; nothing was sampled")
        broken = broken_rows(raw)
        if bool(broken.any()):
            seq = seqs[int(broken.nonzero()[0])]
            raise BrokenLogits(f"the model's logits for request {seq.request.request_id!r} contain NaN or +inf (or "
                               "are all -inf): a broken model or plugin; nothing was sampled")

    def logprob_entry(self, token: int, logprob: float, rank: int, top_ids: list[int],
                      top_logprobs: list[float]) -> PositionLogprobs:
        """One position's log-probabilities: the top tokens (ranked 1…) and the chosen one."""
        entry = {tid: Logprob(lp, r + 1, self._decode_one(tid))
                 for r, (tid, lp) in enumerate(zip(top_ids, top_logprobs))}
        if token not in entry:
            entry[token] = Logprob(logprob, rank, self._decode_one(token))
        return entry

    def _decode_one(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def rewind_on_failure(self, seqs: list[Sequence]) -> Rewind:
        """A context that restores the random generators ``seqs`` draw from if its body raises."""
        gens = [s.generator for s in seqs if s.generator is not None]
        if self.sampler.generator is not None:
            gens.append(self.sampler.generator)
        return Rewind(gens)


__all__ = ["BrokenLogits", "Chosen", "Rewind", "TokenChooser", "sampling_error"]
