"""What the server's queues carry: what each engine step *added*, never cumulative copies.

The engine reports every request after every step with its whole text, token ids and
log-probabilities so far (plus the deltas). Queued as they are, the outputs of a long stream whose
client reads slowly cost memory quadratic in its length; :func:`to_delta` keeps only what was
added, and the prompt's token ids and log-probabilities are shared by reference between a prompt's
deltas. :meth:`OutputDelta.absorb` folds a later delta into an earlier one without losing anything.
"""

from __future__ import annotations

import attrs

from modelrunner.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput


@attrs.define
class CompletionDelta:
    """What one of a request's ``n`` completions added since its previous delta."""

    index: int
    """Which completion (0 … n-1)."""
    delta_text: str
    """Text added."""
    delta_token_ids: list[int]
    """Token ids added."""
    delta_logprobs: list[PositionLogprobs] | None
    """Log-probabilities of the tokens added (None unless asked)."""
    finish_reason: str | None
    """As :attr:`CompletionOutput.finish_reason`: None while running."""
    stop_reason: int | str | None
    """The stop string or token that ended it."""
    num_generated_tokens: int
    """Tokens generated so far in all (for ``usage``)."""

    @property
    def finished(self) -> bool:
        """True once the completion ended."""
        return self.finish_reason is not None

    @classmethod
    def of(cls, completion: CompletionOutput) -> CompletionDelta:
        """The delta part of an engine completion."""
        return cls(index=completion.index, delta_text=completion.delta_text,
                   delta_token_ids=completion.delta_token_ids, delta_logprobs=completion.delta_logprobs,
                   finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                   num_generated_tokens=len(completion.token_ids))

    def absorb(self, later: CompletionDelta) -> None:
        """Append what ``later`` added, and take its state."""
        self.delta_text += later.delta_text
        self.delta_token_ids = self.delta_token_ids + later.delta_token_ids
        if later.delta_logprobs is not None:
            self.delta_logprobs = (self.delta_logprobs or []) + later.delta_logprobs
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
        self.num_generated_tokens = later.num_generated_tokens


@attrs.define
class OutputDelta:
    """One engine request's step, as the handlers see it: :class:`RequestOutput`'s fields but with
    only the deltas of its completions."""

    prompt_token_ids: list[int]
    """The prompt's token ids (the same list object in every delta of a prompt)."""
    prompt_logprobs: list[PositionLogprobs | None] | None
    """The prompt's log-probabilities, when asked (shared like ``prompt_token_ids``)."""
    outputs: list[CompletionDelta]
    """One entry per completion that changed."""
    finished: bool
    """True when every completion ended."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    error: str | None = None
    """Why the request failed."""

    def absorb(self, later: OutputDelta) -> None:
        """Fold ``later`` (the next delta of the same prompt) into this one; nothing is lost."""
        mine = {c.index: c for c in self.outputs}
        for completion in later.outputs:
            if completion.index in mine:
                mine[completion.index].absorb(completion)
            else:
                self.outputs.append(completion)
        self.outputs.sort(key=lambda c: c.index)
        self.finished, self.error = later.finished, later.error
        self.num_cached_tokens = later.num_cached_tokens
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs


def to_delta(output: RequestOutput, previous: OutputDelta | None) -> OutputDelta:
    """The delta of ``output``; ``previous`` (the prompt's first delta) lends its prompt lists."""
    prompt_ids = previous.prompt_token_ids if previous is not None else output.prompt_token_ids
    prompt_logprobs = output.prompt_logprobs
    if previous is not None and previous.prompt_logprobs is not None:
        prompt_logprobs = previous.prompt_logprobs
    return OutputDelta(prompt_token_ids=prompt_ids, prompt_logprobs=prompt_logprobs,
                       outputs=[CompletionDelta.of(c) for c in output.outputs], finished=output.finished,
                       num_cached_tokens=output.num_cached_tokens, error=output.error)
