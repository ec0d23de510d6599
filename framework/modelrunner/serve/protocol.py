"""The request bodies the server accepts (OpenAI's fields plus vLLM's extras), parsed and validated.

Bodies are read and parsed here rather than by FastAPI, so that every failure — a body that is not
JSON, an unknown field, a value of the wrong type — is one 400 naming the field. Values are checked
for type here and for range by :class:`~modelrunner.SamplingParams` (see :mod:`.sampling`).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator
from starlette.requests import Request

from .errors import bad_request, from_validation_errors
from .json_body import load_json

_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    """``stream_options``: what a stream carries besides the text."""

    model_config = _STRICT
    include_usage: bool | None = None
    """Send a last chunk with the usage of the whole request (``choices`` empty)."""
    continuous_usage_stats: bool | None = None
    """vLLM: put the usage so far in every chunk."""


class SamplingRequest(BaseModel):
    """The fields completions and chat completions share."""

    model_config = _STRICT
    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: Any = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    extra_args: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    add_special_tokens: bool | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None or isinstance(value, str) or (isinstance(value, list)
                                                       and all(isinstance(s, str) for s in value)):
            return value
        raise ValueError("must be a string or a list of strings")

    @property
    def streaming(self) -> bool:
        """True when the client asked for server-sent events."""
        return bool(self.stream)

    def usage_options(self) -> tuple[bool, bool]:
        """``(include_usage, continuous_usage_stats)`` of a stream.

        :raises APIError: 400 for ``stream_options`` without ``stream``.
        """
        options = self.stream_options
        if options is None:
            return False, False
        if not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        return bool(options.include_usage), bool(options.continuous_usage_stats)

    def check_unsupported(self) -> None:
        """:raises APIError: 400 for OpenAI fields this server does not implement."""
        for name, value, fine in self._unsupported():
            if value is not None and not fine:
                raise bad_request(f"{name} is not supported by this server (got {value!r})", param=name,
                                  code="unsupported")

    def _unsupported(self) -> list[tuple[str, Any, bool]]:
        return []


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: Any
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def _unsupported(self) -> list[tuple[str, Any, bool]]:
        return [("suffix", self.suffix, False), ("best_of", self.best_of, self.best_of == (self.n or 1))]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if as_prompt_list(value) is None:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of "
                             "token-id lists (non-empty)")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (one entry per prompt)."""
        prompts = as_prompt_list(self.prompt)
        assert prompts is not None  # checked by the validator
        return prompts


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[Any]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None

    def _unsupported(self) -> list[tuple[str, Any, bool]]:
        text_format = self.response_format is None or self.response_format.get("type") == "text"
        no_tools = not self.tools or self.tool_choice == "none"
        return [("response_format", self.response_format, text_format), ("tools", self.tools or None, no_tools),
                ("tool_choice", self.tool_choice, no_tools)]


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or ``messages`` rendered by the chat template."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's)."""

    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


def as_prompt_list(value: Any) -> list[str | list[int]] | None:
    """``prompt`` of a completions request as a list of prompts, or None when it has none of the
    accepted shapes: a string, a list of strings, a list of token ids, a list of token-id lists."""
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(v, str) for v in value):
        return list(value)
    if is_ids(value):
        return [list(value)]
    if all(is_ids(v) for v in value):
        return [list(v) for v in value]
    return None


Model = TypeVar("Model", bound=BaseModel)


async def parse_body(request: Request, model: type[Model]) -> Model:
    """The request's JSON body validated as ``model``.

    :raises APIError: 400 naming the field for a body that is not JSON, not an object, has an
        unknown field, a value of the wrong type or a hostile value (see :mod:`.json_body`; a
        too-large body raises 413 while reading).
    """
    data = load_json(await request.body())
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_errors(e.errors(), model.model_fields) from None
