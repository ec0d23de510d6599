"""``POST /v1/chat/completions``: OpenAI's chat API through the model's chat template, streamed or
not; images as ``data:`` URLs for models that take them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import attrs
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelrunner.engine.outputs import RequestOutput
from .async_engine import Generation
from .chat import ChatOptions, echo_text, parse_messages, render
from .deltas import CompletionDelta, OutputDelta
from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest, parse_body
from .responses import chat_logprobs, new_id, now, prompt_logprobs_json, usage
from .sampling import build_sampling_params, check_room
from .structured import constrain, structured_outputs_of
from .tools import ToolPlan, tool_plan
from .state import ServerState
from .streaming import DONE, EventStream, event, finals_unless_disconnected


@attrs.frozen
class ChatJob:
    """What building the response needs to know about one chat request."""

    id: str
    created: int
    model: str
    n: int
    top_logprobs: int | None
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    prompt_logprobs: bool
    tokenizer: Any
    tools: ToolPlan | None = None
    """How answers may call tools (None: plain text)."""
    prompt_tokens: int = 0
    """The prompt's length, for the usage of the first chunk of a stream (``continuous_usage_stats``)."""
    echo: str = ""
    """Text put before each choice's content (vLLM's ``echo``: the last message, when it has the reply's role)."""
    token_ids_as_text: bool = False
    """Log-probabilities name tokens ``token_id:<id>`` (``return_tokens_as_token_ids``)."""


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    """Handle one chat request.

    :raises APIError: 400 for a bad request, 503 when loading/overloaded, 500 when the engine failed.
    """
    body = await parse_body(request, ChatCompletionRequest)
    served = state.require_model()
    adapter = state.check_model_name(body.model)
    body.check_unsupported()
    include_usage, continuous_usage = body.usage_options()
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.max_completion_tokens is not None:
        max_tokens = (body.max_completion_tokens, "max_completion_tokens")
    elif body.max_tokens is not None:
        max_tokens = (body.max_tokens, "max_tokens")
    else:  # until max_model_len, unless the checkpoint's generation_config says otherwise
        max_tokens = (served.defaults.get("max_tokens"), "max_completion_tokens")
    params = build_sampling_params(body, defaults=served.defaults, max_tokens=max_tokens,
                                   logprobs=(top_logprobs, "top_logprobs"))
    tools = tool_plan(body, state.settings)
    constraint, field = structured_outputs_of(body)
    if tools is not None and tools.forced:
        if constraint is not None:
            raise bad_request(f"{field} and tool_choice {tools.choice!r} both constrain the output; give one",
                              param=field)
        constraint, field = tools.structured_outputs(), "tools"
    parsed = parse_messages(body.messages, served.image_token)
    options = ChatOptions.from_request(body, state.settings)
    prompt = await run_in_threadpool(render, served.llm, served.tokenizer, parsed, options, "messages", tools)
    if body.cache_salt is not None:
        prompt["cache_salt"] = body.cache_salt
    requested = body.max_completion_tokens is not None or body.max_tokens is not None
    check_room([prompt], params, served.max_model_len, max_tokens[1] if requested else None, "messages")
    await constrain(served, params, constraint, field)
    job = ChatJob(id=body.response_id("chatcmpl"), created=now(), model=state.reported_name(adapter), n=params.n,
                  top_logprobs=top_logprobs, include_usage=include_usage, continuous_usage=continuous_usage,
                  return_token_ids=bool(body.return_token_ids), prompt_logprobs=body.prompt_logprobs is not None,
                  tokenizer=served.tokenizer, tools=tools if tools is not None and tools.calls_tools else None,
                  prompt_tokens=len(prompt.get("prompt_token_ids") or ()),
                  echo=echo_text(parsed, options) if body.echo else "",
                  token_ids_as_text=bool(body.return_tokens_as_token_ids))
    # The engine's id is always fresh: a client's request_id need not be unique among live requests.
    generation = await state.generate(new_id("chatcmpl"), [prompt], params, "messages", stream=body.streaming,
                                      lora_request=adapter)
    if body.streaming:
        return EventStream(chat_events(generation, job), generation)
    finals = await finals_unless_disconnected(generation, request)
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(chat_body(finals[0], job))


def _logprobs(job: ChatJob, token_ids: list[int], positions: list | None) -> dict[str, Any] | None:
    if job.top_logprobs is None:
        return None
    return chat_logprobs(token_ids, positions or [], job.top_logprobs, job.tokenizer, job.token_ids_as_text)


def chat_body(output: RequestOutput, job: ChatJob) -> dict[str, Any]:
    """The non-streamed response.

    :raises APIError: 500 when the generation failed.
    """
    if output.error:
        raise APIError(500, f"generation failed: {output.error}", code="generation_failed")
    choices = []
    for completion in output.outputs:
        message: dict[str, Any] = {"role": "assistant", "content": completion.text}
        finish_reason = completion.finish_reason
        if job.tools is not None:
            parsed = job.tools.parse(completion.text, finish_reason)
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = [call.as_openai() for call in parsed.tool_calls]
                if finish_reason != "length":  # a cut answer says so, whatever calls it finished
                    finish_reason = "tool_calls"
        if job.echo:
            message["content"] = job.echo + (message["content"] or "")
        choice: dict[str, Any] = {"index": completion.index, "message": message,
                                  "logprobs": _logprobs(job, completion.token_ids, completion.logprobs),
                                  "finish_reason": finish_reason, "stop_reason": completion.stop_reason}
        if job.return_token_ids:
            choice["token_ids"] = completion.token_ids
        choices.append(choice)
    body: dict[str, Any] = {"id": job.id, "object": "chat.completion", "created": job.created, "model": job.model,
                            "choices": choices, "usage": _usage_of(output)}
    if job.return_token_ids:
        body["prompt_token_ids"] = output.prompt_token_ids
    if job.prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
    return body


def _usage_of(output: RequestOutput | OutputDelta) -> dict[str, Any]:
    return usage(len(output.prompt_token_ids), sum(c.num_generated_tokens for c in output.outputs),
                 output.num_cached_tokens)


async def chat_events(generation: Generation, job: ChatJob) -> AsyncIterator[bytes]:
    """The streamed response: each choice's role chunk, then a chunk per engine step that adds text
    (or tokens, when asked for), each choice's finishing chunk, the usage chunk if asked, ``[DONE]``."""
    def chunk(choices: list[dict[str, Any]], output: OutputDelta | None) -> dict[str, Any]:
        payload: dict[str, Any] = {"id": job.id, "object": "chat.completion.chunk", "created": job.created,
                                   "model": job.model, "choices": choices}
        if job.include_usage:
            payload["usage"] = _usage_of(output) if job.continuous_usage and output is not None else None
        return payload

    first_usage = usage(job.prompt_tokens, 0) if job.include_usage and job.continuous_usage else None
    for index in range(job.n):
        role = chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None}], None)
        if first_usage is not None:  # vLLM: continuous usage from the very first chunk
            role["usage"] = first_usage
        yield event(role)
        if job.echo:
            echoed = chunk([{"index": index, "delta": {"content": job.echo}, "logprobs": None,
                             "finish_reason": None}], None)
            if first_usage is not None:
                echoed["usage"] = first_usage
            yield event(echoed)
    finished: set[int] = set()
    latest: OutputDelta | None = None
    prompt_ids_sent = False
    calls = {index: ToolStream() for index in range(job.n)} if job.tools is not None else None
    async for _, output in generation:
        latest = output
        if output.error:
            yield event(APIError(500, f"generation failed: {output.error}", code="generation_failed").body())
            break
        for completion in output.outputs:
            if completion.index in finished:
                continue
            if calls is not None:
                choices = calls[completion.index].choices(completion, job)
            else:
                choice = _delta_choice(completion, job)
                choices = [] if choice is None else [choice]
            for choice in choices:
                payload = chunk([choice], output)
                if job.return_token_ids and not prompt_ids_sent:  # vLLM: in the first chunk with tokens
                    payload["prompt_token_ids"] = output.prompt_token_ids
                    prompt_ids_sent = True
                yield event(payload)
            if completion.finished:
                finished.add(completion.index)
    else:
        if job.include_usage and latest is not None:
            yield event({"id": job.id, "object": "chat.completion.chunk", "created": job.created,
                         "model": job.model, "choices": [], "usage": _usage_of(latest)})
    yield DONE


def _delta_choice(completion: CompletionDelta, job: ChatJob) -> dict[str, Any] | None:
    """The chunk choice for what ``completion`` added in one step (None when it added nothing to send)."""
    wants_tokens = (job.top_logprobs is not None or job.return_token_ids) and completion.delta_token_ids
    if not (completion.delta_text or completion.finished or wants_tokens):
        return None
    delta = {"content": completion.delta_text} if completion.delta_text else {}
    choice: dict[str, Any] = {"index": completion.index, "delta": delta,
                              "logprobs": _logprobs(job, completion.delta_token_ids, completion.delta_logprobs),
                              "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
    if job.return_token_ids:
        choice["token_ids"] = completion.delta_token_ids
    return choice


class ToolStream:
    """One streamed choice of a request with tools: content is sent as far as the tool plan says it is
    surely content; when the answer finishes, its calls follow as OpenAI streams them (per call, a
    delta with its index, id, type, name and empty arguments, then one with the arguments) and the
    finishing delta says ``finish_reason="tool_calls"``."""

    def __init__(self) -> None:
        self.text = ""
        """The answer so far."""
        self.sent = 0
        """How many of its characters were sent as content."""

    def choices(self, completion: CompletionDelta, job: ChatJob) -> list[dict[str, Any]]:
        """The chunk choices for what ``completion`` added in one step."""
        assert job.tools is not None
        self.text += completion.delta_text
        logprobs = _logprobs(job, completion.delta_token_ids, completion.delta_logprobs)
        tokens = completion.delta_token_ids if job.return_token_ids else None
        if not completion.finished:
            cut = max(self.sent, job.tools.streamable(self.text))
            piece, self.sent = self.text[self.sent:cut], cut
            if not piece and not ((job.top_logprobs is not None or tokens) and completion.delta_token_ids):
                return []
            return [_choice(completion.index, {"content": piece} if piece else {}, logprobs, tokens=tokens,
                            job=job)]
        parsed = job.tools.parse(self.text, completion.finish_reason)
        if not parsed.tool_calls:
            if job.tools.forced:  # a forced answer that is not a call is the server's own JSON: never content
                rest = ""
            elif completion.finish_reason == "length":  # a cut call's markup is not content
                rest = self.text[self.sent:max(self.sent, job.tools.streamable(self.text))].rstrip()
            else:
                rest = self.text[self.sent:]
            return [_choice(completion.index, {"content": rest} if rest else {}, logprobs, completion.finish_reason,
                            completion.stop_reason, tokens, job)]
        sent = self.text[:self.sent].strip()
        content = parsed.content or ""
        rest = content[len(sent):] if content.startswith(sent) else ""
        out = [_choice(completion.index, {"content": rest} if rest else {}, logprobs, tokens=tokens, job=job)]
        for i, call in enumerate(parsed.tool_calls):
            out.append(_choice(completion.index, {"tool_calls": [
                {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]},
                job=job))
            arguments = {"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]}
            out.append(_choice(completion.index, arguments, job=job))
        finish = "length" if completion.finish_reason == "length" else "tool_calls"
        out.append(_choice(completion.index, {}, None, finish, completion.stop_reason, [] if tokens is not None
                           else None, job))
        return out


def _choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None, finish_reason: str | None = None,
            stop_reason: Any = None, tokens: list[int] | None = None, job: ChatJob | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                              "stop_reason": stop_reason}
    if job is not None and job.return_token_ids:
        choice["token_ids"] = tokens or []
    return choice
