"""What the engine reports back: vLLM's ``RequestOutput`` / ``CompletionOutput`` shape."""

from __future__ import annotations

import attrs


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

    @property
    def finished(self) -> bool:
        """True once the completion ended."""
        return self.finish_reason is not None

    @property
    def num_generated_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids)


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

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated over all completions."""
        return sum(len(o.token_ids) for o in self.outputs)
