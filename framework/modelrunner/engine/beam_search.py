"""Beam search (vLLM's ``LLM.beam_search``), on the engine's executor and KV block allocator.

Every prompt is prefilled once; each step decodes every live beam in one batch, and the beams that
survive a step continue in the same sequences: a beam chosen twice is forked through the
allocator (``BlockAllocator.fork``), so its children share the prompt's and the common prefix's KV
blocks copy-on-write instead of recomputing or copying them, and a beam not chosen is freed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ..forward_batch import ForwardBatch
from ..kv_cache.allocator import KVCacheError
from .outputs import Logprob


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def _number(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")


@attrs.define(kw_only=True)
class BeamSearchParams:
    """How :meth:`modelrunner.LLM.beam_search` searches (vLLM's fields)."""

    beam_width: int = attrs.field(validator=_positive)
    """Beams kept per prompt, and sequences returned."""
    max_tokens: int = attrs.field(validator=_positive)
    """Tokens generated per beam at most."""
    ignore_eos: bool = attrs.field(default=False)
    """Keep extending beams past EOS (else a beam that picks EOS is complete)."""
    temperature: float = attrs.field(default=0.0, validator=_number)
    """Logits are divided by it before the log-softmax when above 0."""
    length_penalty: float = attrs.field(default=1.0, validator=_number)
    """Beams are ranked by ``cum_logprob / generated_tokens ** length_penalty`` (as transformers does)."""

    @temperature.validator
    def _temperature(self, attribute: attrs.Attribute, value: float) -> None:
        if value < 0:
            raise ValueError(f"temperature must be >= 0, got {value!r}")


@attrs.define
class BeamSearchSequence:
    """One finished beam."""

    tokens: list[int]
    """Prompt tokens, then the generated ones."""
    logprobs: list[dict[int, Logprob]]
    """Per generated token, its log-probability (and rank)."""
    cum_logprob: float
    """Sum of the generated tokens' log-probabilities."""
    num_prompt_tokens: int
    """How many of :attr:`tokens` are the prompt."""
    text: str | None = None
    """The generated tokens' text (None without a tokenizer)."""
    finish_reason: str = "length"
    """``"stop"`` when it ended at EOS, ``"length"`` at ``max_tokens``."""

    @property
    def generated_tokens(self) -> list[int]:
        """The tokens after the prompt."""
        return self.tokens[self.num_prompt_tokens:]

    def score(self, length_penalty: float) -> float:
        """``cum_logprob / generated_tokens ** length_penalty`` (transformers' beam score)."""
        return self.cum_logprob / max(len(self.generated_tokens), 1) ** length_penalty


@attrs.define
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
    """``beam_width`` sequences, best score first."""


@attrs.define
class _Beam:
    seq_id: int | None
    """The KV sequence holding its tokens (None once complete)."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    num_prompt_tokens: int


class _BeamSequences:
    """The KV sequences one beam search holds, each with how many of its leading tokens have KV
    written (by a forward that returned). Every sequence the search allocates or forks is owned
    here from the moment the allocator hands it out, so :meth:`release_all` gives back every block
    whichever way the search ends, and first takes out of the prefix cache the blocks whose KV no
    forward wrote (a block is hashed when its slots are reserved, before the forward fills it)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._alloc = engine.allocator
        self._executor = engine.executor
        self._owners = engine.scheduler.owners
        self._written: dict[int, int] = {}
        self.lora_of: dict[int, Any] = {}
        """Sequence id → the LoRA adapter (a LoRARequest) its prompt runs with; absent: the base model."""

    def start(self, prompt: list[int], lora_request: Any = None) -> tuple[int, int]:
        """A new sequence for ``prompt`` (run with ``lora_request``, None: the base model): its id and
        how many leading tokens the prefix cache had (of the same adapter)."""
        seq_id = self._engine.next_seq_id()
        keys = () if lora_request is None else (("lora", lora_request.lora_int_id),)
        cached = self._alloc.allocate(seq_id, prompt, keys)
        if lora_request is not None:
            self.lora_of[seq_id] = lora_request
        self._written[seq_id] = cached
        self._owners.allocated(seq_id, cached)
        return seq_id, cached

    def fork(self, parent: int) -> int:
        """A new sequence sharing ``parent``'s blocks; its id."""
        child = self._engine.next_seq_id()
        copies = self._alloc.fork(parent, child)
        self._written[child] = self._written[parent]  # owned before the copy, which may raise
        if parent in self.lora_of:
            self.lora_of[child] = self.lora_of[parent]
        self._owners.forked(parent, child)
        self._executor.copy_blocks(copies)
        return child

    def append(self, seq_id: int, token: int) -> None:
        """Reserve the slot of ``token``, the sequence's next token to compute."""
        copies = self._alloc.append_slots(seq_id, [token])
        self._owners.appended(seq_id, self._alloc.num_tokens(seq_id), copies)
        self._executor.copy_blocks(copies)

    def computed(self, seq_ids: list[int]) -> None:
        """A forward over these sequences returned: every token they have slots for is written."""
        for seq_id in seq_ids:
            self._written[seq_id] = self._alloc.num_tokens(seq_id)

    def free(self, seq_id: int) -> None:
        """Give back one sequence's blocks."""
        written = self._written.pop(seq_id)
        self.lora_of.pop(seq_id, None)
        if written < self._alloc.num_tokens(seq_id):
            self._alloc.forget_uncomputed(seq_id, written)
        self._alloc.free(seq_id)
        self._owners.freed(seq_id)

    def release_all(self) -> None:
        """Give back every sequence still held (the search ended, done or not)."""
        while self._written:
            self.free(next(iter(self._written)))


def with_loras(batch: ForwardBatch, seqs: _BeamSequences) -> ForwardBatch:
    """``batch`` carrying each sequence's LoRA adapter (unchanged when none has one)."""
    loras = {s: seqs.lora_of[s] for s in batch.seq_ids if s in seqs.lora_of}
    if not loras:
        return batch
    ids = tuple(loras[s].lora_int_id if s in loras else 0 for s in batch.seq_ids)
    return attrs.evolve(batch, lora_ids=ids, loras={r.lora_int_id: r for r in loras.values()})


def beam_search(engine: Any, prompts: Sequence[list[int]], params: BeamSearchParams,
                lora_requests: Sequence[Any] | None = None) -> list[BeamSearchOutput]:
    """Beam-search every token-id prompt together; one output per prompt, in order.

    Whichever way it ends (done, out of blocks, a failed forward, an interrupt), the search holds no
    KV block afterwards and leaves no block it did not compute in the prefix cache.

    :param engine: the :class:`~modelrunner.engine.LLMEngine` whose executor and allocator run it.
    :param lora_requests: per prompt, the LoRA adapter it runs with (None: the base model); the search
        runs every prompt in each step, so at most ``max_loras`` distinct adapters.
    :raises ValueError: the KV cache cannot hold the beams (raise ``kv_cache_memory``).
    """
    executor, alloc = engine.executor, engine.allocator
    stops = set() if params.ignore_eos else set(engine.eos_token_ids)
    seqs = _BeamSequences(engine)
    live: list[list[_Beam]] = []
    done: list[list[_Beam]] = [[] for _ in prompts]
    try:
        starts = []
        for i, prompt in enumerate(prompts):
            seq_id, start = seqs.start(list(prompt), lora_requests[i] if lora_requests else None)
            live.append([_Beam(seq_id, list(prompt), [], 0.0, len(prompt))])
            starts.append(start)
        beams = [g[0] for g in live]
        batch = ForwardBatch.build([b.seq_id for b in beams], [b.tokens[s:] for b, s in zip(beams, starts)], starts,
                                   [alloc.block_table(b.seq_id) for b in beams], alloc.block_size,
                                   [[len(b.tokens) - s - 1] for b, s in zip(beams, starts)])
        batch = with_loras(batch, seqs)
        logits = executor.execute_model(batch).logits
        seqs.computed([b.seq_id for b in beams])
        for step in range(params.max_tokens):
            logprobs = _log_softmax(logits, params.temperature)
            rows = iter(range(logprobs.shape[0]))
            chosen_by_group = []
            for g, group in enumerate(live):
                candidates = []
                for beam in group:
                    row = logprobs[next(rows)]
                    top = row.topk(min(2 * params.beam_width, row.shape[0]))
                    for lp, token in zip(top.values.tolist(), top.indices.tolist()):
                        candidates.append((beam.cum_logprob + lp, beam, token, lp, _rank(row, lp)))
                best = heapq.nlargest(2 * params.beam_width, candidates, key=lambda c: c[0])
                continuing = []
                for cum, beam, token, lp, rank in best:
                    entry = {token: Logprob(lp, rank, _decode(engine.tokenizer, [token]))}
                    grown = _Beam(beam.seq_id, beam.tokens + [token], beam.logprobs + [entry], cum,
                                  beam.num_prompt_tokens)
                    if token in stops:  # complete: ranked with the others at the end, uses no more KV
                        done[g].append(attrs.evolve(grown, seq_id=None))
                        continue
                    if len(continuing) < params.beam_width:
                        continuing.append(grown)
                chosen_by_group.append(continuing)
            last = step + 1 == params.max_tokens
            live = [_continue(seqs, old, new, keep_kv=not last) for old, new in zip(live, chosen_by_group)]
            if last or not any(live):
                break
            beams = [b for group in live for b in group]
            batch = ForwardBatch.build([b.seq_id for b in beams], [[b.tokens[-1]] for b in beams],
                                       [len(b.tokens) - 1 for b in beams], [alloc.block_table(b.seq_id) for b in beams],
                                       alloc.block_size, [[0]] * len(beams))
            batch = with_loras(batch, seqs)
            logits = executor.execute_model(batch).logits
            seqs.computed([b.seq_id for b in beams])
    except KVCacheError as e:
        raise ValueError(f"beam search ran out of KV-cache blocks ({e}); raise kv_cache_memory or lower "
                         "beam_width") from e
    finally:
        seqs.release_all()
    outputs = []
    for g, group in enumerate(live):
        finished = done[g] + [attrs.evolve(b, seq_id=None) for b in group]
        finished.sort(key=lambda b: -_score(b, params.length_penalty))
        outputs.append(BeamSearchOutput([
            BeamSearchSequence(b.tokens, b.logprobs, b.cum_logprob, b.num_prompt_tokens,
                               _decode(engine.tokenizer, b.tokens[b.num_prompt_tokens:]),
                               "stop" if b.tokens[-1] in stops else "length")
            for b in finished[:params.beam_width]]))
    return outputs


def _continue(seqs: _BeamSequences, old: list[_Beam], new: list[_Beam], keep_kv: bool) -> list[_Beam]:
    """Give each continuing beam a KV sequence: its parent's own for the parent's first child, a fork
    sharing the parent's blocks for the others; free parents without children. With ``keep_kv``,
    reserve the slot of each beam's new token (copy-on-write of a shared last block)."""
    parents_used: set[int] = set()
    for beam in new:
        if beam.seq_id in parents_used:
            beam.seq_id = seqs.fork(beam.seq_id)
        else:
            parents_used.add(beam.seq_id)
    for beam in old:
        if beam.seq_id not in parents_used:
            seqs.free(beam.seq_id)
    for beam in new:
        if keep_kv:
            seqs.append(beam.seq_id, beam.tokens[-1])
        else:
            seqs.free(beam.seq_id)
            beam.seq_id = None
    return new


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def _rank(row: torch.Tensor, logprob: float) -> int:
    return int((row > logprob).sum()) + 1


def _score(beam: _Beam, length_penalty: float) -> float:
    return beam.cum_logprob / max(len(beam.tokens) - beam.num_prompt_tokens, 1) ** length_penalty


def _decode(tokenizer: Any, tokens: list[int]) -> str | None:
    return None if tokenizer is None else tokenizer.decode(tokens, skip_special_tokens=True)
