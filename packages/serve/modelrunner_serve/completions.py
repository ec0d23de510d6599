"""``POST /v1/completions``: OpenAI's completions API, streamed or not, with vLLM's extras.

Choice ``index`` is ``prompt_index * n + completion_index``. ``echo`` puts the prompt before the
text (and its log-probabilities before the completion's); ``max_tokens=0`` with ``echo`` scores
the prompt without generating, as vLLM does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import attrs
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelrunner.engine.input_processor import check_unicode
from modelrunner.engine.outputs import CompletionOutput, RequestOutput
from .async_engine import Generation
from .deltas import CompletionDelta, OutputDelta
from .errors import APIError, bad_request
from .protocol import CompletionRequest, parse_body
from .responses import completion_logprobs, new_id, now, prompt_logprobs_json, usage
from .sampling import build_sampling_params, check_room
from .structured import constrain, structured_outputs_of
from .state import ServedModel, ServerState
from .streaming import DONE, EventStream, event, finals_unless_disconnected

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for completions."""


@attrs.frozen
class CompletionJob:
    """What building the response needs to know about one completions request."""

    id: str
    created: int
    model: str
    n: int
    echo: bool
    logprobs: int | None
    score_only: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    prompt_logprobs: bool
    tokenizer: Any
    prompt_texts: list[str | None]
    token_ids_as_text: bool = False
    """Log-probabilities name tokens ``token_id:<id>`` (``return_tokens_as_token_ids``)."""

    def prompt_text(self, index: int, output: RequestOutput) -> str:
        """The prompt as text, for ``echo``."""
        text = self.prompt_texts[index]
        if text is None:
            text = self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer is not None else ""
        return text


async def create_completion(request: Request, state: ServerState) -> Response:
    """Handle one completions request.

    :raises APIError: 400 for a bad request, 503 when loading/overloaded, 500 when the engine failed.
    """
    body = await parse_body(request, CompletionRequest)
    served = state.require_model()
    adapter = state.check_model_name(body.model)
    body.check_unsupported()
    include_usage, continuous_usage = body.usage_options()
    echo = bool(body.echo)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    score_only = echo and max_tokens == 0
    if max_tokens == 0 and not echo:
        raise bad_request("max_tokens must be an integer >= 1 (0 is accepted only with echo=true, to score the "
                          "prompt), got 0", param="max_tokens")
    params = build_sampling_params(body, defaults=served.defaults,
                                   max_tokens=(1 if score_only else max_tokens, "max_tokens"),
                                   logprobs=(body.logprobs, "logprobs"))
    if echo and body.logprobs is not None:
        params.prompt_logprobs = max(params.prompt_logprobs or 0, body.logprobs)
    prompts = body.prompts()
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    inputs = await run_in_threadpool(_encode_all, served, prompts, add_special)
    if body.cache_salt is not None:
        for item in inputs:
            item["cache_salt"] = body.cache_salt
    check_room(inputs, params, served.max_model_len, "max_tokens", "prompt")
    await constrain(served, params, *structured_outputs_of(body))
    job = CompletionJob(
        id=body.response_id("cmpl"), created=now(), model=state.reported_name(adapter), n=params.n, echo=echo,
        logprobs=body.logprobs, score_only=score_only, include_usage=include_usage,
        continuous_usage=continuous_usage, return_token_ids=bool(body.return_token_ids),
        prompt_logprobs=body.prompt_logprobs is not None, tokenizer=served.tokenizer,
        prompt_texts=[p if isinstance(p, str) else None for p in prompts],
        token_ids_as_text=bool(body.return_tokens_as_token_ids))
    # The engine's id is always fresh: a client's request_id need not be unique among live requests.
    generation = await state.generate(new_id("cmpl"), inputs, params, "prompt", stream=body.streaming,
                                      lora_request=adapter)
    if body.streaming:
        return EventStream(completion_events(generation, job), generation)
    finals = await finals_unless_disconnected(generation, request)
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(completion_body(finals, job))


def _encode_all(served: ServedModel, prompts: list[str | list[int]], add_special_tokens: bool) -> list[dict]:
    """Tokenize text prompts here, off the engine loop's thread; token ids go as given."""
    inputs = []
    for i, prompt in enumerate(prompts):
        param = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
        if isinstance(prompt, list):
            inputs.append({"prompt_token_ids": prompt})
            continue
        if served.tokenizer is None:
            raise bad_request(f"{param}: this checkpoint ships no tokenizer, so prompts must be token ids",
                              param=param)
        try:
            check_unicode(param, prompt)
        except ValueError as e:
            raise bad_request(str(e), param=param) from None
        if not prompt:
            raise bad_request(f"{param} is empty; give at least one character or token id", param=param)
        inputs.append({"prompt": prompt,
                       "prompt_token_ids": served.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)})
    return inputs


def _generated(completion: CompletionOutput | CompletionDelta, job: CompletionJob,
               delta: bool) -> tuple[str, list[int], list]:
    """The text, token ids and log-probabilities a completion adds (none when only scoring)."""
    if job.score_only:
        return "", [], []
    if delta:
        return completion.delta_text, completion.delta_token_ids, completion.delta_logprobs or []
    return completion.text, completion.token_ids, completion.logprobs or []


def _finish_reason(completion: CompletionOutput | CompletionDelta, job: CompletionJob) -> str | None:
    return "length" if job.score_only and completion.finished else completion.finish_reason


def completion_body(finals: dict[int, RequestOutput], job: CompletionJob) -> dict[str, Any]:
    """The non-streamed response.

    :raises APIError: 500 when a prompt's generation failed.
    """
    choices = []
    prompt_tokens = completion_tokens = cached = 0
    for index in sorted(finals):
        output = finals[index]
        if output.error:
            raise APIError(500, f"generation failed: {output.error}", code="generation_failed")
        prompt_tokens += len(output.prompt_token_ids)
        cached += output.num_cached_tokens
        for completion in output.outputs:
            text, token_ids, positions = _generated(completion, job, delta=False)
            completion_tokens += len(token_ids)
            choice: dict[str, Any] = {"index": index * job.n + completion.index, "text": text, "logprobs": None,
                                      "finish_reason": _finish_reason(completion, job),
                                      "stop_reason": completion.stop_reason}
            if job.echo:
                choice["text"] = job.prompt_text(index, output) + text
            if job.logprobs is not None:
                ids, pos = token_ids, positions
                if job.echo:
                    ids = output.prompt_token_ids + token_ids
                    pos = (output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + positions
                choice["logprobs"] = completion_logprobs(ids, pos, job.tokenizer, as_ids=job.token_ids_as_text)[0]
            _extras(choice, output, token_ids, job, first=True)
            choices.append(choice)
    return {"id": job.id, "object": "text_completion", "created": job.created, "model": job.model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached)}


def _extras(choice: dict[str, Any], output: RequestOutput | OutputDelta, token_ids: list[int], job: CompletionJob,
            first: bool) -> None:
    """vLLM's extra choice fields: ``token_ids``/``prompt_token_ids`` and ``prompt_logprobs``."""
    if job.return_token_ids:
        choice["token_ids"] = token_ids
        choice["prompt_token_ids"] = output.prompt_token_ids if first else None
    if job.prompt_logprobs and first:
        choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)


async def completion_events(generation: Generation, job: CompletionJob) -> AsyncIterator[bytes]:
    """The streamed response: a chunk per completion per engine step that adds text (or tokens, when
    they were asked for), the finishing chunk of each, the usage chunk if asked, and ``[DONE]``."""
    offsets: dict[tuple[int, int], int] = {}
    finished: set[tuple[int, int]] = set()
    latest: dict[int, OutputDelta] = {}
    async for index, output in generation:
        latest[index] = output
        if output.error:
            yield event(APIError(500, f"generation failed: {output.error}", code="generation_failed").body())
            break
        for completion in output.outputs:
            key = (index, completion.index)
            if key in finished:
                continue
            text, token_ids, positions = _generated(completion, job, delta=True)
            first = key not in offsets
            if first:
                offsets[key] = 0
            ids, pos = token_ids, positions
            if first and job.echo:
                text = job.prompt_text(index, output) + text
                ids = output.prompt_token_ids + token_ids
                pos = (output.prompt_logprobs or [None] * len(output.prompt_token_ids)) + positions
            wants_tokens = (job.logprobs is not None or job.return_token_ids) and ids
            if not (text or completion.finished or wants_tokens or first and job.prompt_logprobs):
                continue
            choice: dict[str, Any] = {"index": index * job.n + completion.index, "text": text, "logprobs": None,
                                      "finish_reason": _finish_reason(completion, job),
                                      "stop_reason": completion.stop_reason}
            if job.logprobs is not None:
                choice["logprobs"], offsets[key] = completion_logprobs(ids, pos, job.tokenizer, offsets[key],
                                                                       job.token_ids_as_text)
            _extras(choice, output, token_ids, job, first)
            chunk: dict[str, Any] = {"id": job.id, "object": "text_completion", "created": job.created,
                                     "model": job.model, "choices": [choice]}
            if job.include_usage:
                chunk["usage"] = _usage_of(output, job) if job.continuous_usage else None
            yield event(chunk)
            if completion.finished:
                finished.add(key)
    else:
        if job.include_usage:
            totals = [_usage_of(o, job) for o in latest.values()]
            yield event({"id": job.id, "object": "text_completion", "created": job.created, "model": job.model,
                         "choices": [], "usage": usage(sum(u["prompt_tokens"] for u in totals),
                                                       sum(u["completion_tokens"] for u in totals),
                                                       sum(o.num_cached_tokens for o in latest.values()))})
    yield DONE


def _usage_of(output: OutputDelta, job: CompletionJob) -> dict[str, Any]:
    generated = 0 if job.score_only else sum(c.num_generated_tokens for c in output.outputs)
    return usage(len(output.prompt_token_ids), generated, output.num_cached_tokens)
