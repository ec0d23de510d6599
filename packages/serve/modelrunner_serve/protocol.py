"""The request bodies the server accepts (OpenAI's fields plus vLLM's extras), parsed and validated.

Bodies are read and parsed here rather than by FastAPI, so that every failure — a body that is not
JSON, an unknown field, a value of the wrong type — is one 400 naming the field. Values are checked
for type here and for range by :class:`~modelrunner.SamplingParams` (see :mod:`.sampling`).

Every field of openai-python's request types and of vLLM's ``ChatCompletionRequest`` and
``CompletionRequest`` is accepted (tests walk them), so a client that sends OpenAI's or vLLM's own
fields is never refused for them: those that have no meaning here are ignored with one debug log
line per request (``ignored_fields``), those asking for what this server does not do are refused
saying so (``check_unsupported``: only values that cannot be honoured, never the defaults), and any
other field is still an unknown one (a 400 that catches typos, as OpenAI's own API does). Inside
``messages``, unknown keys are ignored as vLLM ignores them (see :mod:`.chat`).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, create_model, field_validator
from starlette.requests import Request

from .errors import bad_request, from_validation_errors
from .json_body import load_json
from .responses import new_id
from .sampling import REQUEST_FIELDS

logger = logging.getLogger("modelrunner.serve")

_STRICT = ConfigDict(extra="forbid", strict=True)


class OpenAIRequest(BaseModel):
    """A request body: unknown fields refused, OpenAI's meaningless ones ignored, unsupported ones refused."""

    model_config = _STRICT
    ignored_fields: ClassVar[tuple[str, ...]] = ()
    """OpenAI's fields that have no meaning on this server: accepted, and ignored with a debug line."""
    accepted_values: ClassVar[dict[str, str]] = {}
    """What an unsupported field accepts, for its error message (default: leaving it out)."""

    def check_unsupported(self) -> None:
        """Refuse what the server does not implement, then name the ignored fields the request sets
        in one debug line.

        :raises APIError: 400 ``unsupported`` naming the field, its value and what it accepts.
        """
        for name, value, fine in self._unsupported():
            if value is not None and not fine:
                accepted = self.accepted_values.get(name, "leave it out")
                raise bad_request(f"{name} is not supported by this server (got {_shown(value)}); accepted: "
                                  f"{accepted}", param=name, code="unsupported")
        ignored = [name for name in self.ignored_fields if getattr(self, name) is not None]
        if ignored and logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: ignoring %s (no meaning on this server)", type(self).__name__, ", ".join(ignored))

    def _unsupported(self) -> list[tuple[str, Any, bool]]:
        """``(field, value, acceptable)`` for each field the server implements only in part."""
        return []


def _shown(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class StreamOptions(BaseModel):
    """``stream_options``: what a stream carries besides the text."""

    model_config = _STRICT
    include_usage: bool | None = None
    """Send a last chunk with the usage of the whole request (``choices`` empty)."""
    continuous_usage_stats: bool | None = None
    """vLLM: put the usage so far in every chunk."""
    include_obfuscation: bool | None = None
    """OpenAI: pad chunks against side channels (accepted and ignored: nothing here needs it)."""


SamplingFields = create_model(
    "SamplingFields", __base__=OpenAIRequest, __module__=__name__,
    **{name: (kind, None) for name, kind in REQUEST_FIELDS.items()})
"""Every :class:`~modelrunner.SamplingParams` field a request sets under its own name, typed for JSON
(derived from SamplingParams: a new parameter is a request field without a line here)."""


REQUEST_ID_MAX_CHARS = 256
"""Longest ``request_id`` a request may give (it becomes the response's ``id``)."""


class SamplingRequest(SamplingFields):
    """The fields completions and chat completions share: the sampling parameters (:data:`SamplingFields`)
    and these."""

    ignored_fields = ("user", "length_penalty", "spaces_between_special_tokens")
    accepted_values = {"use_beam_search": "false or leave it out (the server samples; beam search is offline only, "
                                          "LLM.beam_search)",
                       "priority": "0 or leave it out (requests are scheduled first come, first served)",
                       "kv_transfer_params": "leave it out (no disaggregated prefill here)",
                       "structural_tag": "leave it out (give response_format, structured_outputs or guided_*)"}
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool | None = None
    add_special_tokens: bool | None = None
    # structured outputs (see .structured): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    structural_tag: str | None = None
    # vLLM's other extras (see docs/guide/serving.md, "vLLM's request fields")
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    """Beam search's; without beam search (vLLM's default, and all this server serves) it has no effect."""
    spaces_between_special_tokens: bool | None = None
    """Only slow tokenizers read it; fast ones (all this server loads) decode the same either way, as in vLLM."""
    priority: int | None = None
    request_id: str | None = None
    """The response's ``id`` becomes ``<prefix>-<request_id>`` (vLLM's way)."""
    cache_salt: str | None = None
    """Prefix-cache blocks are shared only between requests with the same salt (and with none between
    salted and unsalted ones)."""
    return_tokens_as_token_ids: bool | None = None
    """Log-probabilities name tokens ``token_id:<id>`` instead of their text."""
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    """vLLM's name for ``extra_args`` (free-form arguments for plugins)."""

    @field_validator("request_id", "cache_salt")
    @classmethod
    def _non_empty(cls, value: str | None) -> str | None:
        if value is not None and not 0 < len(value) <= REQUEST_ID_MAX_CHARS:
            raise ValueError(f"must be a non-empty string of at most {REQUEST_ID_MAX_CHARS} characters")
        return value

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

    def _unsupported(self) -> list[tuple[str, Any, bool]]:
        return [("use_beam_search", self.use_beam_search, not self.use_beam_search),
                ("priority", self.priority, self.priority == 0),
                ("kv_transfer_params", self.kv_transfer_params, not self.kv_transfer_params),
                ("structural_tag", self.structural_tag, False)]

    def response_id(self, prefix: str) -> str:
        """The response's ``id``: ``<prefix>-<request_id>`` when the request gave one, else a fresh one."""
        return f"{prefix}-{self.request_id}" if self.request_id is not None else new_id(prefix)

    def sampling_extra_args(self) -> dict[str, Any] | None:
        """``extra_args`` for SamplingParams: the request's ``extra_args`` or vLLM's ``vllm_xargs``.

        :raises APIError: 400 when both are given.
        """
        extra = getattr(self, "extra_args", None)
        if extra is not None and self.vllm_xargs is not None:
            raise bad_request("extra_args and vllm_xargs are two names for the same arguments; give one",
                              param="vllm_xargs")
        return self.vllm_xargs if self.vllm_xargs is not None else extra

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


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: Any
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    prompt_embeds: Any = None

    accepted_values = {**SamplingRequest.accepted_values, "best_of": "the same value as n, or leave it out",
                       "prompt_embeds": "leave it out (give prompt as text or token ids)"}

    def _unsupported(self) -> list[tuple[str, Any, bool]]:
        return [*super()._unsupported(), ("suffix", self.suffix, False),
                ("best_of", self.best_of, self.best_of == (self.n or 1)), ("prompt_embeds", self.prompt_embeds, False)]

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
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # vLLM's chat extras
    echo: bool | None = None
    """Put the last message's text before the reply when it has the reply's role (vLLM's ``echo``)."""
    documents: list[dict[str, str]] | None = None
    """Given to the chat template as ``documents`` (retrieval-augmented templates read them)."""
    include_reasoning: bool | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    best_of: int | None = None
    # OpenAI's fields for what this server does not do: refused unless they ask for nothing
    audio: Any = None
    modalities: list[str] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    # OpenAI's fields with no meaning here (ignored_fields)
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: Any = None
    moderation: Any = None
    prediction: Any = None
    web_search_options: Any = None

    ignored_fields = ("user", "store", "metadata", "service_tier", "reasoning_effort", "verbosity", "prompt_cache_key",
                      "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "moderation",
                      "prediction", "web_search_options", "length_penalty", "spaces_between_special_tokens",
                      "include_reasoning")
    accepted_values = {**SamplingRequest.accepted_values, "audio": "leave it out (replies are text)",
                       "modalities": "['text'] or leave it out", "functions": "leave them out, or function_call 'none'",
                       "function_call": "'none' or leave it out", "best_of": "the same value as n, or leave it out",
                       "mm_processor_kwargs": "leave it out (images are prepared by the model's own processor "
                                              "with its defaults)"}

    def _unsupported(self) -> list[tuple[str, Any, bool]]:
        no_functions = not self.functions or self.function_call == "none"
        return [*super()._unsupported(), ("audio", self.audio, False),
                ("modalities", self.modalities, set(self.modalities or ()) <= {"text"}),
                ("functions", self.functions or None, no_functions),
                ("function_call", self.function_call, no_functions),
                ("best_of", self.best_of, self.best_of == (self.n or 1)),
                ("mm_processor_kwargs", self.mm_processor_kwargs, not self.mm_processor_kwargs)]


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
