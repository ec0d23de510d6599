"""``POST /v1/responses``: OpenAI's Responses API for plain text, streamed or not.

``input`` (a string, or message items as the API and ``response.output`` give them) after
``instructions`` (a system message) is rendered by the chat template, as a chat request would be,
and the reply is one ``message`` output item holding one ``output_text`` part. A stream is OpenAI's
named events: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` per step that adds text, then
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done`` and
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` ended it,
``response.failed`` when generating failed). Nothing is stored: ``previous_response_id`` and
``conversation`` are refused, and so, for now, are ``tools``. ``text.format`` asks for structured
output as chat's ``response_format`` does (``json_schema`` with its ``schema``, or ``json_object``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import attrs
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import StructuredOutputError
from ..sampling.structured import StructuredOutputsParams
from .async_engine import Generation
from .chat import ChatOptions, ParsedMessages, parse_messages, render
from .errors import APIError, bad_request
from .protocol import OpenAIRequest, parse_body
from .responses import new_id, now
from .sampling import build_sampling_params, check_room
from .structured import constrain
from .state import ServerState
from .streaming import EventStream, finals_unless_disconnected

ITEM_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
"""Accepted keys of a message item in ``input`` (``id``, ``status`` and ``phase`` come with items
taken from a previous response's ``output``, and are not used)."""
PART_TYPES = {"input_text": "text", "output_text": "text", "refusal": "refusal", "input_image": "image_url"}
"""Content part types of ``input`` messages → the chat part each becomes."""


class ResponsesRequest(OpenAIRequest):
    """``POST /v1/responses``: OpenAI's fields, plus vLLM's sampling extras."""

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    top_logprobs: int | None = None
    truncation: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    # OpenAI's fields with no meaning here (ignored_fields)
    parallel_tool_calls: bool | None = None
    max_tool_calls: Any = None
    include: Any = None
    reasoning: Any = None
    stream_options: Any = None
    store: Any = None
    metadata: Any = None
    user: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None
    context_management: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None
    # vLLM's sampling extras on this endpoint
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None

    ignored_fields = ("parallel_tool_calls", "max_tool_calls", "include", "reasoning", "stream_options", "store",
                      "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
                      "prompt_cache_retention", "prompt_cache_options", "moderation", "context_management", "image",
                      "access_programs", "background_options")
    accepted_values = {
        "tools": "leave them out (tools on /v1/responses are not supported yet)",
        "tool_choice": "'auto', 'none' or leave it out", "top_logprobs": "0 or leave it out",
        "truncation": "'disabled' or leave it out (a conversation too long for the context is a 400)",
        "previous_response_id": "leave it out (nothing is stored: send the whole conversation as input)",
        "conversation": "leave it out (nothing is stored: send the whole conversation as input)",
        "prompt": "leave it out (no stored prompt templates: send input and instructions)",
        "background": "false or leave it out"}

    def _unsupported(self) -> list[tuple[str, Any, bool]]:
        return [("tools", self.tools or None, False),
                ("tool_choice", self.tool_choice, self.tool_choice in ("auto", "none")),
                ("top_logprobs", self.top_logprobs, self.top_logprobs == 0),
                ("truncation", self.truncation, self.truncation == "disabled"),
                ("previous_response_id", self.previous_response_id, False), ("conversation", self.conversation, False),
                ("prompt", self.prompt, False), ("background", self.background, not self.background)]


@attrs.frozen
class ResponseJob:
    """What building the response needs to know about one request: its ids and the request fields
    the response object echoes."""

    id: str
    message_id: str
    created_at: int
    model: str
    echo: dict[str, Any]
    """The request's settings as the response reports them (``instructions``, ``temperature`` …)."""

    def response(self, status: str, output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        """OpenAI's ``Response`` object in state ``status``."""
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": error,
                "incomplete_details": None if incomplete is None else {"reason": incomplete},
                "model": self.model, "output": output or [], "previous_response_id": None, "store": False,
                "tools": [], "truncation": "disabled", "usage": usage,
                **self.echo}

    def message(self, text: str, status: str) -> dict[str, Any]:
        """The reply's output item."""
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def create_response(request: Request, state: ServerState) -> Response:
    """Handle one responses request.

    :raises APIError: 400 for a bad request, 503 when loading/overloaded, 500 when the engine failed.
    """
    body = await parse_body(request, ResponsesRequest)
    served = state.require_model()
    adapter = state.check_model_name(body.model)
    body.check_unsupported()
    if body.input is None:
        raise bad_request("input is required: a string, or a list of message items ({'role', 'content'})",
                          param="input", code="missing_field")
    max_tokens = body.max_output_tokens if body.max_output_tokens is not None else served.defaults.get("max_tokens")
    params = build_sampling_params(body, defaults=served.defaults, max_tokens=(max_tokens, "max_output_tokens"),
                                   logprobs=(None, "top_logprobs"))
    parsed = parse_messages(input_messages(body.input), served.image_token, param="input")
    if body.instructions is not None:
        parsed = ParsedMessages([{"role": "system", "content": body.instructions}, *parsed.conversation],
                                parsed.image_urls)
    constraint = text_format(body.text)
    prompt = await run_in_threadpool(render, served.llm, served.tokenizer, parsed, ChatOptions(
        chat_template=state.settings.chat_template), "input")
    check_room([prompt], params, served.max_model_len,
               "max_output_tokens" if body.max_output_tokens is not None else None, "input")
    await constrain(served, params, constraint, "text.format")
    job = ResponseJob(id=new_id("resp"), message_id=new_id("msg"), created_at=now(), model=state.reported_name(adapter),
                      echo={"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                            "temperature": params.temperature, "top_p": params.top_p,
                            "tool_choice": body.tool_choice or "auto",
                            "parallel_tool_calls": body.parallel_tool_calls is not False,
                            "metadata": body.metadata or {}, "user": body.user,
                            "text": {"format": (body.text or {}).get("format") or {"type": "text"}}})
    generation = await state.generate(job.id, [prompt], params, "input", stream=bool(body.stream),
                                      lora_request=adapter)
    if body.stream:
        return EventStream(response_events(generation, job), generation)
    finals = await finals_unless_disconnected(generation, request)
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    output = finals[0]
    if output.error:
        raise APIError(500, f"generation failed: {output.error}", code="generation_failed")
    completion = output.outputs[0]
    status, incomplete = _status(completion.finish_reason)
    usage = _usage(len(output.prompt_token_ids), len(completion.token_ids), output.num_cached_tokens)
    return JSONResponse(job.response(status, [job.message(completion.text, status)], usage, incomplete=incomplete))


def text_format(text: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """The constraint ``text.format`` asks for (None: plain text).

    :raises APIError: 400 naming ``text.format`` for an unknown type or a ``json_schema`` without schema.
    """
    fmt = (text or {}).get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is None or kind == "text":
        return None
    try:
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise bad_request("text.format.schema is required with type 'json_schema': {'type': 'json_schema', "
                                  "'name': ..., 'schema': {...}}", param="text.format.schema")
            return StructuredOutputsParams(json=fmt["schema"])
    except StructuredOutputError as e:
        raise bad_request(f"text.format: {e}", param="text.format") from None
    raise bad_request(f"text.format.type must be one of text, json_object, json_schema; got {kind!r}",
                      param="text.format.type")


def input_messages(value: str | list[Any]) -> list[dict[str, Any]]:
    """``input`` as chat messages (``parse_messages`` checks them further, naming ``input[i]``).

    :raises APIError: 400 naming the item or part at fault and what is accepted.
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be a message item {{'role', 'content'}}, got {type(item).__name__}",
                              param=where)
        kind = item.get("type", "message")
        if kind != "message":
            raise bad_request(f"{where}.type {kind!r} is not supported by this server; accepted: 'message' "
                              "(function calls and their outputs are not supported yet)", param=f"{where}.type",
                              code="unsupported")
        unknown = sorted(set(item) - ITEM_KEYS)
        if unknown:
            raise bad_request(f"{where} has unknown field {unknown[0]!r}; accepted: {', '.join(sorted(ITEM_KEYS))}",
                              param=f"{where}.{unknown[0]}", code="unknown_field")
        content = item.get("content")
        if isinstance(content, list):
            content = [_chat_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
        messages.append({"role": item.get("role"), "content": content})
    return messages


def _chat_part(part: Any, where: str) -> Any:
    """A Responses content part as the chat part :func:`parse_messages` reads."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in PART_TYPES:
        got = repr(kind) if isinstance(part, dict) else type(part).__name__
        raise bad_request(f"{where}.type must be one of {', '.join(PART_TYPES)}; got {got}", param=f"{where}.type")
    chat_kind = PART_TYPES[kind]
    if chat_kind == "text":
        return {"type": "text", "text": part.get("text")}
    if chat_kind == "refusal":
        return {"type": "refusal", "refusal": part.get("refusal")}
    url = part.get("image_url")
    if not isinstance(url, str):
        raise bad_request(f"{where}.image_url must be a data: URL (file_id images are not supported)",
                          param=f"{where}.image_url")
    return {"type": "image_url", "image_url": {"url": url}}


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    """The response's ``status`` and ``incomplete_details.reason`` for how its text ended."""
    if finish_reason == "stop":
        return "completed", None
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "incomplete", finish_reason or "abort"


def _usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def named_event(kind: str, payload: dict[str, Any]) -> bytes:
    """One server-sent event with an ``event:`` name, as OpenAI streams responses."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def response_events(generation: Generation, job: ResponseJob) -> AsyncIterator[bytes]:
    """The streamed response: OpenAI's ``response.*`` events, numbered by ``sequence_number``."""
    numbers: Iterator[int] = itertools.count()

    def emit(kind: str, **fields: Any) -> bytes:
        return named_event(kind, {"type": kind, "sequence_number": next(numbers), **fields})

    where = {"item_id": job.message_id, "output_index": 0, "content_index": 0}
    yield emit("response.created", response=job.response("in_progress"))
    yield emit("response.in_progress", response=job.response("in_progress"))
    yield emit("response.output_item.added", output_index=0, item=job.message("", "in_progress"))
    yield emit("response.content_part.added", **where, part=_text_part(""))
    text, finish_reason, generated, prompt_tokens, cached = "", None, 0, 0, 0
    async for _, output in generation:
        if output.error:
            error = {"code": "server_error", "message": f"generation failed: {output.error}"}
            yield emit("response.failed", response=job.response("failed", error=error))
            return
        prompt_tokens, cached = len(output.prompt_token_ids), output.num_cached_tokens
        for completion in output.outputs:
            generated = completion.num_generated_tokens
            finish_reason = completion.finish_reason or finish_reason
            if completion.delta_text:
                text += completion.delta_text
                yield emit("response.output_text.delta", **where, delta=completion.delta_text, logprobs=[])
    status, incomplete = _status(finish_reason)
    yield emit("response.output_text.done", **where, text=text, logprobs=[])
    yield emit("response.content_part.done", **where, part=_text_part(text))
    item = job.message(text, status)
    yield emit("response.output_item.done", output_index=0, item=item)
    final = job.response(status, [item], _usage(prompt_tokens, generated, cached), incomplete=incomplete)
    yield emit("response.completed" if status == "completed" else "response.incomplete", response=final)
