"""``POST /v1/responses``: OpenAI's Responses API for plain text, streamed or not.

``input`` (a string, or message items as the API and ``response.output`` give them) after
``instructions`` (a system message) is rendered by the chat template, as a chat request would be,
and the reply is one ``message`` output item holding one ``output_text`` part. A stream is OpenAI's
named events: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` per step that adds text, then
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done`` and
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` ended it,
``response.failed`` when generating failed). Nothing is stored: ``previous_response_id`` and
``conversation`` are refused. ``text.format`` asks for structured output as chat's
``response_format`` does (``json_schema`` with its ``schema``, or ``json_object``).

``tools`` (function tools, ``{"type": "function", "name", "description", "parameters"}``) and
``tool_choice`` (``none``, ``auto``, ``required`` or ``{"type": "function", "name"}``) work as on
chat completions (see :mod:`.tools`): each call is a ``function_call`` output item, after the
``message`` item when the answer also has text; streamed, a call is ``response.output_item.added``,
``response.function_call_arguments.delta`` and ``.done``, then ``response.output_item.done``. Calls
and their results come back as ``function_call`` and ``function_call_output`` input items.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import attrs
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelrunner.errors import StructuredOutputError
from modelrunner.sampling.structured import StructuredOutputsParams, as_structured_outputs
from .async_engine import Generation
from .chat import ChatOptions, ParsedMessages, parse_messages, render
from .errors import APIError, bad_request, from_validation_errors
from .input_bounds import check_input_bounds
from .json_body import load_json
from .protocol import OpenAIRequest
from .responses import new_id, now
from .sampling import build_sampling_params, check_room
from modelrunner.tool_parser import ToolCall
from .structured import constrain
from .state import ServerState
from .streaming import EventStream, finals_unless_disconnected
from .tools import ToolPlan, tool_plan

ITEM_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
"""Accepted keys of a message item in ``input`` (``id``, ``status`` and ``phase`` come with items
taken from a previous response's ``output``, and are not used)."""
CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
"""Accepted keys of a ``function_call`` item in ``input`` (a call from a previous response's output)."""
CALL_OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
"""Accepted keys of a ``function_call_output`` item in ``input`` (a call's result)."""
INPUT_TYPES = ("message", "function_call", "function_call_output")
"""Accepted ``input`` item types."""
TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
"""Accepted keys of a function tool (``strict`` is accepted and needs nothing: forced calls always
follow the parameters' schema)."""
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
    structured_outputs: dict[str, Any] | None = None

    ignored_fields = ("max_tool_calls", "include", "reasoning", "stream_options", "store",
                      "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
                      "prompt_cache_retention", "prompt_cache_options", "moderation", "context_management", "image",
                      "access_programs", "background_options")
    accepted_values = {
        "top_logprobs": "0 or leave it out",
        "truncation": "'disabled' or leave it out (a conversation too long for the context is a 400)",
        "previous_response_id": "leave it out (nothing is stored: send the whole conversation as input)",
        "conversation": "leave it out (nothing is stored: send the whole conversation as input)",
        "prompt": "leave it out (no stored prompt templates: send input and instructions)",
        "background": "false or leave it out"}

    def _unsupported(self) -> list[tuple[str, Any, bool]]:
        return [("top_logprobs", self.top_logprobs, self.top_logprobs == 0),
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
    tools: ToolPlan | None = None
    """How the answer may call functions (None: plain text)."""

    def response(self, status: str, output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        """OpenAI's ``Response`` object in state ``status``."""
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": error,
                "incomplete_details": None if incomplete is None else {"reason": incomplete},
                "model": self.model, "output": output or [], "previous_response_id": None, "store": False,
                "truncation": "disabled", "usage": usage,
                **self.echo}

    def message(self, text: str, status: str) -> dict[str, Any]:
        """The reply's text as an output item."""
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_text_part(text)]}

    def output(self, text: str, status: str) -> tuple[list[dict[str, Any]], bool]:
        """The finished answer's output items (its text as a message, then a ``function_call`` per call)
        and whether it holds calls."""
        if self.tools is None:
            return [self.message(text, status)], False
        parsed = self.tools.parse(text)
        items = [self.message(parsed.content or "", status)] if parsed.content or not parsed.tool_calls else []
        return items + [function_call_item(call) for call in parsed.tool_calls], bool(parsed.tool_calls)


def function_call_item(call: ToolCall, arguments: str | None = None, status: str = "completed") -> dict[str, Any]:
    """A call as a ``function_call`` output item (``arguments`` replaces the call's while streaming)."""
    return {"id": call.id.replace("call_", "fc_", 1), "type": "function_call", "status": status, "call_id": call.id,
            "name": call.name, "arguments": call.arguments if arguments is None else arguments}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def create_response(request: Request, state: ServerState) -> Response:
    """Handle one responses request.

    :raises APIError: 400 for a bad request, 503 when loading/overloaded, 500 when the engine failed.
    """
    raw = await request.body()
    large = len(raw) > OFF_LOOP_BYTES
    body = await run_in_threadpool(parse_request, raw) if large else parse_request(raw)
    served = state.require_model()
    adapter = state.check_model_name(body.model)
    body.check_unsupported()
    if body.input is None:
        raise bad_request("input is required: a string, or a list of message items ({'role', 'content'})",
                          param="input", code="missing_field")
    max_tokens = body.max_output_tokens if body.max_output_tokens is not None else served.defaults.get("max_tokens")
    params = build_sampling_params(body, defaults=served.defaults, max_tokens=(max_tokens, "max_output_tokens"),
                                   logprobs=(None, "top_logprobs"))
    parsed = await run_in_threadpool(conversation_of, body, served.tokenizer, served.max_model_len,
                                     state.settings.max_input_items, served.image_token)
    constraint, field = text_format(body.text), "text.format"
    if body.structured_outputs is not None:  # vLLM's extra: regex, choice, grammar … as on chat
        if constraint is not None:
            raise bad_request("text.format and structured_outputs both constrain the output; give one",
                              param="structured_outputs")
        try:
            constraint, field = as_structured_outputs(dict(body.structured_outputs)), "structured_outputs"
        except (StructuredOutputError, TypeError) as e:
            raise bad_request(f"structured_outputs: {e}", param="structured_outputs") from None
    tools = tool_plan(chat_tools(body), state.settings)
    if tools is not None and tools.forced:
        if constraint is not None:
            raise bad_request(f"{field} and tool_choice {tools.choice!r} both constrain the output; give one",
                              param=field)
        constraint, field = tools.structured_outputs(), "tools"
    prompt = await run_in_threadpool(render, served.llm, served.tokenizer, parsed, ChatOptions(
        chat_template=state.settings.chat_template), "input", tools)
    check_room([prompt], params, served.max_model_len,
               "max_output_tokens" if body.max_output_tokens is not None else None, "input")
    await constrain(served, params, constraint, field)
    job = ResponseJob(id=new_id("resp"), message_id=new_id("msg"), created_at=now(), model=state.reported_name(adapter),
                      echo={"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                            "temperature": params.temperature, "top_p": params.top_p,
                            "tool_choice": body.tool_choice or "auto",
                            "parallel_tool_calls": body.parallel_tool_calls is not False,
                            "metadata": body.metadata or {}, "user": body.user,
                            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
                            "tools": list(body.tools or [])},
                      tools=tools if tools is not None and tools.calls_tools else None)
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
    items, _ = job.output(completion.text, status)
    return JSONResponse(job.response(status, items, usage, incomplete=incomplete))


OFF_LOOP_BYTES = 64 << 10
"""Bodies larger than this are parsed and checked in a worker thread, not on the event loop that
serves every other request's stream."""


def parse_request(raw: bytes) -> ResponsesRequest:
    """The body as a :class:`ResponsesRequest` (call it off the event loop for a large body).

    :raises APIError: 400 naming the field (see :func:`~.protocol.parse_body`).
    """
    data = load_json(raw)
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as e:
        raise from_validation_errors(e.errors(), ResponsesRequest.model_fields) from None


def conversation_of(body: ResponsesRequest, tokenizer: Any, max_model_len: int, max_items: int,
                    image_token: str | None) -> ParsedMessages:
    """``instructions`` and ``input`` as checked chat messages, after the bounds that need no tokenizer
    (:func:`~.input_bounds.check_input_bounds`); call it off the event loop (50,000 items take seconds).

    :raises APIError: 400 naming the item or field at fault, or the bound it exceeds.
    """
    check_input_bounds(body.input, body.instructions, tokenizer, max_model_len, max_items)
    parsed = parse_messages(input_messages(body.input), image_token, param="input")
    if body.instructions is not None:
        parsed = ParsedMessages([{"role": "system", "content": body.instructions}, *parsed.conversation],
                                parsed.image_urls)
    return parsed


def chat_tools(body: ResponsesRequest) -> SimpleNamespace:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` in chat completions' shape,
    which :func:`~.tools.tool_plan` reads.

    :raises APIError: 400 naming the tool or field at fault: a tool that is not a function tool, an
        unknown key, a missing name, ``tool_choice`` in neither accepted form.
    """
    functions = None
    if body.tools:
        functions = []
        for i, tool in enumerate(body.tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise bad_request(f"{where} must be a function tool {{'type': 'function', 'name', 'description', "
                                  f"'parameters'}}; got {type(tool).__name__}", param=where)
            if tool.get("type") != "function":
                raise bad_request(f"{where}.type {tool.get('type')!r} is not supported by this server; accepted: "
                                  "'function' (built-in tools such as web_search are OpenAI's own)",
                                  param=f"{where}.type", code="unsupported")
            unknown = sorted(set(tool) - TOOL_KEYS)
            if unknown:
                raise bad_request(f"{where} has unknown field {unknown[0]!r}; accepted: {', '.join(sorted(TOOL_KEYS))}",
                                  param=f"{where}.{unknown[0]}", code="unknown_field")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise bad_request(f"{where}.name must be a non-empty string", param=f"{where}.name")
            for key, kind, what in (("parameters", dict, "a JSON schema object"), ("description", str, "a string")):
                if tool.get(key) is not None and not isinstance(tool[key], kind):
                    raise bad_request(f"{where}.{key} must be {what}", param=f"{where}.{key}")
            functions.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                               if tool.get(k) is not None}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}; "
                              f"got {choice!r:.200}", param="tool_choice")
        names = [f["function"]["name"] for f in functions or []]
        if functions and choice["name"] not in names:
            raise bad_request(f"tool_choice names the function {choice['name']!r}, which is not in tools (given: "
                              f"{', '.join(names)})", param="tool_choice.name")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return SimpleNamespace(tools=functions, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls)


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
        if kind not in INPUT_TYPES:
            raise bad_request(f"{where}.type {kind!r} is not supported by this server; accepted: "
                              f"{', '.join(INPUT_TYPES)}", param=f"{where}.type", code="unsupported")
        if kind == "function_call":
            _add_call(messages, item, where)
            continue
        if kind == "function_call_output":
            messages.append(_call_output(item, where))
            continue
        unknown = sorted(set(item) - ITEM_KEYS)
        if unknown:
            raise bad_request(f"{where} has unknown field {unknown[0]!r}; accepted: {', '.join(sorted(ITEM_KEYS))}",
                              param=f"{where}.{unknown[0]}", code="unknown_field")
        content = item.get("content")
        if isinstance(content, list):
            content = [_chat_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
        messages.append({"role": item.get("role"), "content": content})
    return messages


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A ``function_call`` item as a call of the assistant message it follows (a new one if the last
    message is not the assistant's)."""
    _check_keys(item, CALL_KEYS, where)
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise bad_request(f"{where}.{key} must be a {'' if key == 'arguments' else 'non-empty '}string "
                              f"(a function_call item is {{'type', 'call_id', 'name', 'arguments'}})",
                              param=f"{where}.{key}")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    if messages and messages[-1].get("role") == "assistant":
        messages[-1] = {**messages[-1], "tool_calls": [*(messages[-1].get("tool_calls") or []), call]}
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call_output`` item as a ``tool`` message."""
    _check_keys(item, CALL_OUTPUT_KEYS, where)
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise bad_request(f"{where}.call_id must be a non-empty string: the call_id of the function_call it answers",
                          param=f"{where}.call_id")
    output = item.get("output")
    if isinstance(output, list):
        output = [_chat_part(part, f"{where}.output[{j}]") for j, part in enumerate(output)]
    elif not isinstance(output, str):
        raise bad_request(f"{where}.output must be a string or a list of input_text parts", param=f"{where}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _check_keys(item: dict[str, Any], accepted: frozenset[str], where: str) -> None:
    unknown = sorted(set(item) - accepted)
    if unknown:
        raise bad_request(f"{where} has unknown field {unknown[0]!r}; accepted: {', '.join(sorted(accepted))}",
                          param=f"{where}.{unknown[0]}", code="unknown_field")


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
    """The streamed response: OpenAI's ``response.*`` events, numbered by ``sequence_number``.

    Without tools the message item opens at once and every step's text is a delta. With tools, text
    is sent as far as the tool plan says it is surely content (the message item opens with the first
    such text), and the calls follow when the answer is finished."""
    numbers: Iterator[int] = itertools.count()

    def emit(kind: str, **fields: Any) -> bytes:
        return named_event(kind, {"type": kind, "sequence_number": next(numbers), **fields})

    where = {"item_id": job.message_id, "output_index": 0, "content_index": 0}
    opened = False

    def open_message() -> list[bytes]:
        nonlocal opened
        opened = True
        return [emit("response.output_item.added", output_index=0, item=job.message("", "in_progress")),
                emit("response.content_part.added", **where, part=_text_part(""))]

    yield emit("response.created", response=job.response("in_progress"))
    yield emit("response.in_progress", response=job.response("in_progress"))
    if job.tools is None:
        for event in open_message():
            yield event
    text, sent, finish_reason, generated, prompt_tokens, cached = "", 0, None, 0, 0, 0
    async for _, output in generation:
        if output.error:
            error = {"code": "server_error", "message": f"generation failed: {output.error}"}
            yield emit("response.failed", response=job.response("failed", error=error))
            return
        prompt_tokens, cached = len(output.prompt_token_ids), output.num_cached_tokens
        for completion in output.outputs:
            generated = completion.num_generated_tokens
            finish_reason = completion.finish_reason or finish_reason
            text += completion.delta_text
            cut = len(text) if job.tools is None else max(sent, job.tools.streamable(text))
            piece, sent = text[sent:cut], cut
            if piece:
                if not opened:
                    for event in open_message():
                        yield event
                yield emit("response.output_text.delta", **where, delta=piece, logprobs=[])
    status, incomplete = _status(finish_reason)
    items, has_calls = job.output(text, status)
    calls = [item for item in items if item["type"] == "function_call"]
    if has_calls:  # the content the parser found, less what was sent already
        content = items[0]["content"][0]["text"] if items[0]["type"] == "message" else ""
        streamed = text[:sent].strip()
        rest = content[len(streamed):] if content.startswith(streamed) else ""
    else:
        rest = text[sent:]
    index = 0
    if opened or rest or not has_calls:  # the message item holds what was streamed as text
        if not opened:
            for event in open_message():
                yield event
        if rest:
            yield emit("response.output_text.delta", **where, delta=rest, logprobs=[])
        final_text = text[:sent] + rest
        message = job.message(final_text, status)
        yield emit("response.output_text.done", **where, text=final_text, logprobs=[])
        yield emit("response.content_part.done", **where, part=_text_part(final_text))
        yield emit("response.output_item.done", output_index=0, item=message)
        items, index = [message, *calls], 1
    for call in calls:
        yield emit("response.output_item.added", output_index=index, item={**call, "arguments": "",
                                                                           "status": "in_progress"})
        yield emit("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                   delta=call["arguments"])
        yield emit("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                   arguments=call["arguments"], name=call["name"])
        yield emit("response.output_item.done", output_index=index, item=call)
        index += 1
    final = job.response(status, items, _usage(prompt_tokens, generated, cached), incomplete=incomplete)
    yield emit("response.completed" if status == "completed" else "response.incomplete", response=final)
