"""What the engine reports back: vLLM's ``RequestOutput`` / ``CompletionOutput`` shape."""

from __future__ import annotations

import attrs

from ..sampling.logprobs import Logprob, PositionLogprobs  # noqa: F401 - Logprob: re-exported, its old home
from ..wire import register as _wire_type


@_wire_type
@attrs.define
class RequestMetrics:
    """When things happened to a request (``time.monotonic()`` seconds)."""

    arrival_time: float
    """When the request was added."""
    first_scheduled_time: float | None = None
    """When its prompt first ran in a step."""
    first_token_time: float | None = None
    """When its first token was sampled."""
    last_token_time: float | None = None
    """When its latest token was sampled."""
    finished_time: float | None = None
    """When it finished."""
    num_generated_tokens: int = 0
    """Tokens generated over all completions."""
    spec_num_drafts: int = 0
    """Speculative decoding: verifications of proposed tokens (one per completion and step that speculated)."""
    spec_num_draft_tokens: int = 0
    """Speculative decoding: tokens proposed and scored by the target."""
    spec_num_accepted_tokens: int = 0
    """Speculative decoding: proposed tokens the target accepted."""

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted over proposed tokens (None when nothing was proposed)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification: accepted drafts plus the target's own one (None without any)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between tokens after the first (None with fewer than two)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to finishing."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@_wire_type
@attrs.define
class CompletionOutput:
    """One of a request's ``n`` completions, as of the latest step."""

    index: int
    """Which completion (0 … n-1)."""
    text: str
    """Generated text so far (cut before a stop string)."""
    token_ids: list[int]
    """Generated token ids so far (a stop token or EOS that ended it is included)."""
    finish_reason: str | None = None
    """``"stop"`` (EOS, stop string or stop token), ``"length"`` (max_tokens or max_model_len),
    ``"abort"``, ``"error"``; None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it (None for EOS)."""
    delta_text: str = ""
    """Text added since the previous report of this request (what a stream prints)."""
    delta_token_ids: list[int] = attrs.field(factory=list)
    """Token ids added since the previous report."""
    logprobs: list[PositionLogprobs] | None = None
    """Per generated token, the top ``SamplingParams.logprobs`` tokens' and the chosen token's
    log-probabilities (None unless asked)."""
    cumulative_logprob: float | None = None
    """Sum of the chosen tokens' log-probabilities (None unless ``logprobs`` was asked)."""
    delta_logprobs: list[PositionLogprobs] | None = None
    """The entries of ``logprobs`` added since the previous report."""

    @property
    def finished(self) -> bool:
        """True once the completion ended."""
        return self.finish_reason is not None

    @property
    def num_generated_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids)


@_wire_type
@attrs.define
class RequestOutput:
    """The state of one request after a step (the last one has ``finished=True``)."""

    request_id: str
    """The id given to ``add_request`` (``LLM.generate`` numbers prompts ``"0"``, ``"1"``, …)."""
    prompt: str | None
    """The prompt text, when it was given as text."""
    prompt_token_ids: list[int]
    """The prompt's token ids."""
    outputs: list[CompletionOutput]
    """One entry per completion that exists so far, by index."""
    finished: bool
    """True when every completion ended."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of being computed."""
    error: str | None = None
    """Why the request failed (then ``finished`` is True and ``finish_reason`` is ``"error"``)."""
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """Per prompt token, its log-probability and the top ``prompt_logprobs`` at its position (None
    for the first token, which nothing predicts); None unless asked."""
    metrics: RequestMetrics | None = None
    """When the request arrived, was first scheduled, got its first token and finished."""

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated over all completions."""
        return sum(len(o.token_ids) for o in self.outputs)
