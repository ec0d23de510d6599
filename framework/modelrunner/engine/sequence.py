"""The state the engine keeps per request and per generated sequence."""

from __future__ import annotations

import enum
from typing import Any

import attrs
import torch

from ..sampling.params import SamplingParams
from .outputs import PositionLogprobs, RequestMetrics


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    """Queued; holds no KV-cache blocks (new, or preempted and to be recomputed)."""
    RUNNING = "running"
    """Holds blocks; scheduled every step until it finishes or is preempted."""
    FINISHED = "finished"
    """Done; its blocks are freed."""


_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    """SplitMix64's finaliser: every bit of ``value`` affects every bit of the result."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def child_seed(seed: int, index: int) -> int:
    """The generator seed of completion ``index`` of a request seeded with ``seed``.

    Completion 0 of a seed in ``[0, 2**32)`` uses ``seed`` itself, so ``n=1`` with a seed matches
    the first of ``n>1``. torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so
    any other value (a seed of 2**32 or more, a negative one, a child's) is first mixed down to 32
    bits: seeds that differ only above bit 31 (1 and 2**32 + 1) sample differently. (Negative seeds
    are read as torch reads them, modulo 2**64: -1 and 2**64 - 1 are the same seed.)
    """
    value = seed & _MASK64
    if index:
        value = (value * 6364136223846793005 + index * 1442695040888963407) & _MASK64
    elif value < 1 << 32:
        return value
    return _splitmix64(value) >> 32


@attrs.define(eq=False)
class Sequence:
    """One token stream: the prompt followed by one completion's tokens."""

    seq_id: int
    """Engine-wide id; the allocator and the model's per-sequence state key on it."""
    request: Request
    """The request this sequence answers."""
    index: int
    """Which of the request's ``n`` completions this is."""
    token_ids: list[int]
    """Prompt tokens, then generated tokens."""
    generator: torch.Generator | None = None
    """This sequence's own random generator when the request is seeded."""
    num_computed_tokens: int = 0
    """Leading tokens whose KV is in the cache (prefix-cache hits count as computed)."""
    status: SequenceStatus = SequenceStatus.WAITING
    """Life-cycle state."""
    finish_reason: str | None = None
    """``"stop"``, ``"length"`` or ``"abort"`` once finished."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it (None for EOS or length)."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache the first time the sequence was allocated."""
    output_text: str = ""
    """Detokenized completion so far (cut before a stop string)."""
    prefix_offset: int = 0
    """Incremental detokenization: start of the token window decoded for context."""
    read_offset: int = 0
    """Incremental detokenization: tokens before this are already in ``output_text``."""
    sent_text_len: int = 0
    """Characters of ``output_text`` already reported as deltas."""
    sent_token_len: int = 0
    """Generated tokens already reported as deltas."""
    logprobs: list[PositionLogprobs] | None = None
    """Per generated token, its and the top tokens' log-probabilities (when the request asks)."""
    cumulative_logprob: float | None = None
    """Sum of the generated tokens' log-probabilities (when the request asks)."""
    grammar: Any = None
    """Where this completion is in its request's structured-output grammar (a
    :class:`~modelrunner.structured_output.GrammarMatcher`; None: unconstrained, or not compiled yet)."""

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return self.request.num_prompt_tokens

    @property
    def params(self) -> SamplingParams:
        """The request's sampling parameters."""
        return self.request.params

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens."""
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.request.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        """True once the sequence ended."""
        return self.status is SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Forget the cached KV (after preemption): everything is computed again later."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    @classmethod
    def first_of(cls, request: Request, seq_id: int) -> Sequence:
        """A new request's first (or only) completion: its prompt, a generator of its own when the
        request is seeded, log-probability lists when it asks for them."""
        seed = request.params.seed
        generator = None if seed is None else torch.Generator().manual_seed(child_seed(seed, 0))
        seq = cls(seq_id=seq_id, request=request, index=0, token_ids=list(request.prompt_token_ids),
                  generator=generator)
        if request.params.logprobs is not None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        return seq

    def fork(self, seq_id: int, index: int) -> Sequence:
        """A copy of this sequence as completion ``index`` of the same request."""
        seed = self.request.params.seed
        generator = None if seed is None else torch.Generator().manual_seed(child_seed(seed, index))
        return attrs.evolve(self, seq_id=seq_id, index=index, token_ids=list(self.token_ids), generator=generator,
                            logprobs=None if self.logprobs is None else list(self.logprobs), grammar=None)


@attrs.define(eq=False)
class Request:
    """One ``add_request`` call: a prompt, its parameters, and its ``n`` sequences."""

    request_id: str
    """The caller's id."""
    prompt: str | None
    """The prompt text, when it was given as text."""
    prompt_token_ids: list[int]
    """The prompt's token ids."""
    params: SamplingParams
    """Sampling and stopping rules."""
    arrival: int
    """Arrival order (ties in scheduling go to the earlier request)."""
    metrics: RequestMetrics
    """When it arrived, was first scheduled, got its first token, finished."""
    extra: dict[str, Any] = attrs.field(factory=dict)
    """Adapter inputs (e.g. ``images``) passed to the model in ``ForwardBatch.extra``."""
    extra_keys: tuple = ()
    """Hashable identity of ``extra``, so prefix caching never mixes different images."""
    seqs: list[Sequence] = attrs.field(factory=list)
    """Sequence 0 first; the other ``n - 1`` appear when the prompt is prefilled (fork)."""
    forked: bool = False
    """True once all ``n`` sequences exist."""
    error: str | None = None
    """Why the request failed, when it did."""
    processor_states: dict[str, Any] = attrs.field(factory=dict)
    """Logits processor name → its state for this request (only the processors it uses)."""
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """Per prompt position, the logprobs of the prompt token there (when the request asks)."""
    grammar: Any = None
    """Its structured-output constraint, compiled or compiling (a
    :class:`~modelrunner.structured_output.manager.CompiledGrammar`; None: unconstrained)."""

    lora_request: Any = None
    """The LoRA adapter it runs with (a :class:`~modelrunner.lora.LoRARequest`; None: the base model)."""
    pooling: Any = None
    """An embedding request's :class:`~modelrunner.engine.pooling.PoolingState` (None: it generates);
    it samples nothing and ends once its prompt is computed."""

    @property
    def lora_int_id(self) -> int:
        """Its adapter's ``lora_int_id`` (0: the base model)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        """True when every completion has ended."""
        return (self.forked or self.params.n == 1) and all(s.is_finished for s in self.seqs)
