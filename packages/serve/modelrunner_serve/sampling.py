"""A request's sampling fields → :class:`~modelrunner.SamplingParams`, every value checked by
SamplingParams itself, so the server accepts exactly what the offline API accepts and says so in
the same words, naming the request's own field."""

from __future__ import annotations

import types
import typing
from typing import Any, Optional, Union

import attrs

from modelrunner.sampling.params import GENERATION_CONFIG, REQUEST, REQUEST_TYPE, SamplingParams
from .errors import APIError, bad_request, leading_field


def json_type(annotation: Any) -> Any:
    """The type a JSON body gives a value of Python type ``annotation``: tuples arrive as lists, dict
    keys as strings (``tuple[int, ...] | None`` → ``list[int] | None``)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return Union[tuple(json_type(a) for a in args)]
    if origin is tuple:
        return list[json_type(args[0])] if args else list
    if origin is dict:
        return dict[str, json_type(args[1])] if args else dict
    return annotation


def request_fields() -> dict[str, Any]:
    """Every :class:`~modelrunner.SamplingParams` field a request sets under its own name → the JSON
    type it takes there (None allowed: left out, the field keeps its default): all of them but those
    whose metadata says otherwise (:data:`~modelrunner.sampling.params.REQUEST`), typed by their
    ``REQUEST_TYPE`` metadata or their own annotation."""
    hints = typing.get_type_hints(SamplingParams)
    return {field.name: Optional[field.metadata.get(REQUEST_TYPE, json_type(hints[field.name]))]
            for field in attrs.fields(SamplingParams) if field.metadata.get(REQUEST, True)}


REQUEST_FIELDS = request_fields()
"""SamplingParams field → its type in a request body (:class:`~.protocol.SamplingRequest` is built from it)."""
PASSED_THROUGH = tuple(REQUEST_FIELDS)
"""SamplingParams fields a request sets under the same name."""
GENERATION_CONFIG_FIELDS = tuple(field.name for field in attrs.fields(SamplingParams)
                                 if GENERATION_CONFIG in field.metadata and field.name in REQUEST_FIELDS)
"""Fields whose default comes from the checkpoint's ``generation_config.json`` when the request
omits them (as vLLM does)."""


def build_sampling_params(request: Any, *, defaults: dict[str, Any],
                          max_tokens: tuple[int | None, str], logprobs: tuple[int | None, str]) -> SamplingParams:
    """SamplingParams for ``request`` (a :class:`~.protocol.SamplingRequest`, or any request body:
    the :data:`PASSED_THROUGH` fields it lacks are left at their defaults).

    :param defaults: the checkpoint's generation defaults (:data:`GENERATION_CONFIG_FIELDS`).
    :param max_tokens: the value and the request field it came from (``max_completion_tokens`` …).
    :param logprobs: the number of top log-probabilities (None: none) and the field it came from.
    :raises APIError: 400 naming the request's field and what it accepts.
    """
    names = {"max_tokens": max_tokens[1], "logprobs": logprobs[1]}
    values: dict[str, Any] = {}
    for field in PASSED_THROUGH:
        value = getattr(request, field, None)
        if field == "extra_args" and hasattr(request, "sampling_extra_args"):
            value = request.sampling_extra_args()  # or vLLM's name for it, vllm_xargs
        if value is None and field in GENERATION_CONFIG_FIELDS:
            value = defaults.get(field)
        if value is not None:
            values[field] = value
    values["max_tokens"] = max_tokens[0]
    if logprobs[0] is not None:
        values["logprobs"] = logprobs[0]
    params = SamplingParams()
    for field, value in values.items():
        try:
            setattr(params, field, value)  # SamplingParams checks each field as it is set
        except (ValueError, TypeError) as e:
            raise _named(e, field, names) from None
    try:
        params.validate()  # the rules between fields
    except ValueError as e:
        raise _named(e, leading_field(str(e)) or "", names) from None
    return params


def _named(error: Exception, field: str, names: dict[str, str]) -> APIError:
    """``error`` as a 400 whose message and ``param`` use the request's name for ``field``."""
    param = names.get(field, field) or None
    message = str(error)
    if param and param != field and message.startswith(field):
        message = param + message[len(field):]
    return bad_request(message, param=param)


def check_room(prompts: list[dict[str, Any]], params: SamplingParams, max_model_len: int, param: str | None,
               prompt_param: str) -> None:
    """Refuse at once a request whose prompt and ``max_tokens`` together exceed the context, as vLLM
    does (generating would run until ``max_model_len`` and stop short of what was asked).

    :param prompts: the engine prompts, with their ``prompt_token_ids``.
    :param param: the request field ``params.max_tokens`` came from (None: it did not come from the
        request, and is not checked).
    :param prompt_param: the request field the prompts came from.
    :raises APIError: 400 ``context_length_exceeded`` naming ``param``, the numbers and what is accepted.
        A prompt that fills the context by itself is left to the engine, whose error names the prompt.
    """
    max_tokens = params.max_tokens
    if param is None or max_tokens is None:
        return
    for i, prompt in enumerate(prompts):
        ids = prompt.get("prompt_token_ids")
        if ids is None:
            continue
        length = len(ids)
        if params.truncate_prompt_tokens is not None:
            length = min(length, params.truncate_prompt_tokens)
        if length >= max_model_len or length + max_tokens <= max_model_len:
            continue
        where = f"{prompt_param}[{i}]" if len(prompts) > 1 else "your request"
        raise bad_request(f"{param} is too large: {max_tokens}. This model's maximum context length is "
                          f"{max_model_len} tokens and {where} has {length} input tokens ({max_tokens} > "
                          f"{max_model_len} - {length}); accepted: {param} <= {max_model_len - length}",
                          param=param, code="context_length_exceeded")
