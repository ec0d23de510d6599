"""``POST /v1/embeddings``: OpenAI's embeddings API (with vLLM's extras) on the engine's pooling requests.

``input`` is a string, a list of strings, a list of token ids, or a list of token-id lists; each
prompt becomes one engine request with :class:`~modelrunner.pooling.PoolingParams`, batched with
whatever else the engine runs. ``encoding_format`` ``"float"`` answers lists of floats, ``"base64"``
the little-endian float32 bytes, base64-encoded (what OpenAI's client asks for by default and
decodes). ``dimensions`` shortens a Matryoshka model's embeddings and is refused (400) for others.
"""

from __future__ import annotations

import asyncio
import base64
import sys
from typing import Any, ClassVar

from fastapi import APIRouter, Depends
from pydantic import field_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelrunner.engine.input_processor import check_unicode
from modelrunner.engine.loop import EngineDeadError
from modelrunner.pooling.params import PoolingParams
from .async_engine import AsyncEngine, EngineStopped, NeverFits, Overloaded, PromptRejected, RETRY_AFTER_S
from .auth import require_api_key
from .errors import APIError, bad_request, leading_field
from .protocol import REQUEST_ID_MAX_CHARS, OpenAIRequest, parse_body
from .responses import new_id, now
from .state import ServedModel, ServerState
from .streaming import wait_for_disconnect

ENCODING_FORMATS = ("float", "base64")
"""What ``encoding_format`` accepts."""
POOLING_FIELDS = ("dimensions", "normalize", "truncate_prompt_tokens")
"""Request fields the engine checks as :class:`PoolingParams` (its refusals name them)."""


class EmbeddingRequest(OpenAIRequest):
    """The body of ``POST /v1/embeddings``: OpenAI's fields plus vLLM's (``truncate_prompt_tokens``,
    ``normalize``, ``add_special_tokens``, ``request_id``; ``priority``, ``embed_dtype`` and
    ``endianness`` at the values this server produces)."""

    ignored_fields: ClassVar[tuple[str, ...]] = ("user",)
    accepted_values: ClassVar[dict[str, str]] = {
        "priority": "0 (requests are scheduled first come, first served)",
        "embed_dtype": "float32 (or leave it out)",
        "endianness": "little or native (the server writes little-endian float32)"}
    model: str | None = None
    """The served model's name (or a LoRA adapter's); None: the base model."""
    input: Any = None
    """A string, a list of strings, a list of token ids, or a list of token-id lists (checked by :func:`prompts_of`)."""
    encoding_format: str | None = None
    """``float`` (default) or ``base64``."""
    dimensions: int | None = None
    """Matryoshka truncation: keep the first this many entries (renormalised)."""
    user: str | None = None
    """OpenAI's end-user id (ignored)."""
    truncate_prompt_tokens: int | None = None
    """vLLM: keep only the last this many tokens of each input."""
    normalize: bool | None = None
    """vLLM: L2-normalise (None: the model's default)."""
    add_special_tokens: bool | None = None
    """vLLM: let the tokenizer add its special tokens to text inputs (default True)."""
    request_id: str | None = None
    """vLLM: the response's ``id`` is ``embd-<request_id>``."""
    priority: int | None = None
    """vLLM: only 0."""
    embed_dtype: str | None = None
    """vLLM: the dtype base64 embeddings are written in; only ``float32``."""
    endianness: str | None = None
    """vLLM: the byte order of base64 embeddings; ``little`` (``native`` on a little-endian machine)."""

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, value: str | None) -> str | None:
        if value is not None and not 0 < len(value) <= REQUEST_ID_MAX_CHARS:
            raise ValueError(f"must be a non-empty string of at most {REQUEST_ID_MAX_CHARS} characters")
        return value

    def _unsupported(self) -> list[tuple[str, Any, bool]]:
        native = "native" if sys.byteorder == "little" else "little"
        return [("priority", self.priority, self.priority == 0),
                ("embed_dtype", self.embed_dtype, self.embed_dtype == "float32"),
                ("endianness", self.endianness, self.endianness in ("little", native))]


def prompts_of(value: Any) -> tuple[list[str | list[int]], bool]:
    """The prompts of an ``input`` (one per string or token-id list), and whether ``input`` listed them
    (errors then name ``input[i]``).

    :raises APIError: 400 naming ``input`` (or ``input[i]``) for anything else, or an empty input.
    """
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    accepted = "a string, a list of strings, a list of token ids, or a list of token-id lists"
    if value is None:
        raise bad_request(f"input is required: {accepted}", param="input", code="missing_field")
    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif is_ids(value) and value:
        prompts = [value]
    elif isinstance(value, list) and value:
        prompts = value
    elif isinstance(value, list):
        raise bad_request(f"input is empty; give {accepted}", param="input")
    else:
        raise bad_request(f"input must be {accepted}; got {type(value).__name__}", param="input")
    listed = prompts is value  # input was a list of prompts: name each by its index
    for i, prompt in enumerate(prompts):
        param = f"input[{i}]" if listed else "input"
        if isinstance(prompt, str) or is_ids(prompt):
            if len(prompt) == 0:
                raise bad_request(f"{param} is empty; give at least one character or token id", param=param)
            continue
        raise bad_request(f"{param} must be a string or a list of token ids (all of one kind in a list); got "
                          f"{type(prompt).__name__}", param=param)
    if len({isinstance(p, str) for p in prompts}) > 1:
        raise bad_request("input mixes strings and token-id lists; send one kind per request", param="input")
    return prompts, listed


def _param(index: int, listed: bool) -> str:
    return f"input[{index}]" if listed else "input"


def _tokenize(served: ServedModel, prompts: list[str | list[int]], listed: bool,
              add_special_tokens: bool) -> list[dict[str, Any]]:
    """Each prompt as the engine takes it: text tokenized here (off the engine loop's thread), ids as given."""
    inputs = []
    for i, prompt in enumerate(prompts):
        param = _param(i, listed)
        if isinstance(prompt, list):
            inputs.append({"prompt_token_ids": prompt})
            continue
        if served.tokenizer is None:
            raise bad_request(f"{param}: this checkpoint ships no tokenizer, so inputs must be token ids", param=param)
        try:
            check_unicode(param, prompt)
        except ValueError as e:
            raise bad_request(str(e), param=param) from None
        inputs.append({"prompt": prompt,
                       "prompt_token_ids": served.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)})
    return inputs


def _check_lengths(inputs: list[dict[str, Any]], listed: bool, params: PoolingParams, max_model_len: int) -> None:
    keep = params.truncate_prompt_tokens
    for i, item in enumerate(inputs):
        count = len(item["prompt_token_ids"])
        if count > max_model_len and (keep is None or keep > max_model_len):
            param = _param(i, listed)
            raise bad_request(f"{param} has {count} tokens but max_model_len is {max_model_len}; accepted: at most "
                              f"{max_model_len} tokens per input (or set truncate_prompt_tokens)", param=param,
                              code="context_length_exceeded")


async def pool(engine: AsyncEngine, request_id: str, inputs: list[dict[str, Any]], params: PoolingParams,
               lora_request: Any, request: Request) -> list[Any] | None:
    """Run one pooling request per input on the engine loop; their final outputs in input order, or
    None when the client went away first (whatever still runs is then aborted).

    :raises NeverFits: more inputs than the engine admits at once, however idle.
    :raises Overloaded: admitting them now would exceed what the engine admits.
    :raises PromptRejected: the engine refused an input (the others are aborted).
    :raises EngineStopped: the engine is not running.
    """
    engine.check_alive()
    count = len(inputs)
    if count > engine.max_in_flight:
        raise NeverFits(f"{count} inputs can never be admitted at once; accepted: at most {engine.max_in_flight} "
                        f"inputs per request ({engine.limits})")
    if engine.in_flight + count > engine.max_in_flight:
        raise Overloaded(f"the server has {engine.in_flight} requests in flight and admits at most "
                         f"{engine.max_in_flight} (max_num_seqs + max_waiting_requests); retry later")
    aio = asyncio.get_running_loop()
    results: list[asyncio.Future] = [aio.create_future() for _ in inputs]
    ids = [f"{request_id}-{i}" for i in range(count)]
    metrics = engine.metrics

    def consumer(index: int) -> Any:
        def on_output(output: Any) -> None:  # in the engine loop's thread
            if not output.finished:
                return
            observe(metrics, output)
            try:
                aio.call_soon_threadsafe(lambda: results[index].done() or results[index].set_result(output))
            except RuntimeError:  # the event loop is closed: nobody waits for it
                pass
        return on_output

    admitted = 0
    engine.in_flight += count
    try:
        try:
            queued = []
            for index, item in enumerate(inputs):
                queued.append(engine.loop.add_request(ids[index], item, params, on_output=consumer(index),
                                                      lora_request=lora_request))
                admitted += 1
            accepted = await asyncio.gather(*(asyncio.wrap_future(f) for f in queued), return_exceptions=True)
        except EngineDeadError as e:
            raise EngineStopped(str(e)) from None
        for index, result in enumerate(accepted):
            if isinstance(result, ValueError):
                raise PromptRejected(index, str(result))
            if isinstance(result, EngineDeadError):
                raise EngineStopped(str(result))
            if isinstance(result, BaseException):
                raise result
        done = asyncio.ensure_future(asyncio.gather(*results))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not done.done():
            done.cancel()
            return None
        return done.result()
    finally:
        engine.in_flight -= count
        for index in range(admitted):
            if not results[index].done():
                engine.abort(ids[index])


def observe(metrics: Any, output: Any) -> None:
    """Count a finished pooling request in the server's metrics (its prompt tokens, reason and latency)."""
    m = metrics
    if output.prompt_token_ids:
        m.prompt_tokens.inc(len(output.prompt_token_ids))
        m.request_prompt_tokens.observe(len(output.prompt_token_ids))
    m.finished("error" if output.error else (getattr(output, "finish_reason", None) or "abort"))
    latency = getattr(output.metrics, "e2e_latency", None) if output.metrics is not None else None
    if latency is not None:
        m.e2e_latency.observe(latency)


def encode_embedding(data: Any, encoding_format: str) -> list[float] | str:
    """One embedding as JSON: a list of floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(data.float().contiguous().numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()


async def create_embedding(request: Request, state: ServerState) -> Response:
    """Handle one embeddings request.

    :raises APIError: 400 for a bad request (naming the field), 503 when loading/overloaded, 500 when
        the engine or the pooling failed.
    """
    body = await parse_body(request, EmbeddingRequest)
    served = state.require_model()
    adapter = state.check_model_name(body.model)
    body.check_unsupported()
    if getattr(served.llm, "router", None) is not None:
        raise bad_request("embeddings are not served with data_parallel_size > 1 yet; start the server with one "
                          "replica", param="input", code="unsupported")
    encoding_format = body.encoding_format or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise bad_request(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}; got {encoding_format!r}",
                          param="encoding_format")
    prompts, listed = prompts_of(body.input)
    params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize,
                           truncate_prompt_tokens=body.truncate_prompt_tokens)
    try:
        params.validate()
    except ValueError as e:
        raise bad_request(str(e), param=leading_field(str(e))) from None
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    inputs = await run_in_threadpool(_tokenize, served, prompts, listed, add_special)
    _check_lengths(inputs, listed, params, served.max_model_len)
    engine = state.engine
    assert engine is not None  # require_model() came first
    job_id = f"embd-{body.request_id}" if body.request_id is not None else new_id("embd")
    try:
        outputs = await pool(engine, job_id, inputs, params, adapter, request)
    except NeverFits as e:
        raise bad_request(f"input: {e}", param="input", code="too_many_prompts") from None
    except Overloaded as e:
        raise APIError(503, str(e), code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except EngineStopped as e:
        state.require_model()  # answers the engine's death as every route does
        raise APIError(500, str(e), code="engine_dead") from None
    except PromptRejected as e:
        message = str(e).split("': ", 1)[-1] if str(e).startswith("request '") else str(e)
        field = leading_field(message)
        if field in POOLING_FIELDS:
            raise bad_request(message, param=field) from None
        param = _param(e.index, listed)
        code = "context_length_exceeded" if "max_model_len" in message else "invalid_value"
        raise bad_request(message if message.startswith(param) else f"{param}: {message}", param=param,
                          code=code) from None
    if outputs is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    data = []
    prompt_tokens = 0
    for index, output in enumerate(outputs):
        embedding = getattr(getattr(output, "outputs", None), "data", None)
        if embedding is None:
            why = output.error or f"it ended with finish_reason {getattr(output, 'finish_reason', None)!r}"
            raise APIError(500, f"embedding input[{index}] failed: {why}", code="embedding_failed")
        prompt_tokens += len(output.prompt_token_ids)
        data.append({"object": "embedding", "index": index, "embedding": encode_embedding(embedding, encoding_format)})
    return JSONResponse({"id": job_id, "object": "list", "created": now(), "model": state.reported_name(adapter),
                         "data": data, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


def _state(request: Request) -> ServerState:
    return request.app.state.server


embedding_routes = APIRouter(dependencies=[Depends(require_api_key)])
"""The embeddings route (API key required when set); ``build_app`` includes it."""


@embedding_routes.post("/v1/embeddings", summary="OpenAI embeddings: pooled final hidden states (vLLM's extras)")
async def embeddings(request: Request) -> Response:
    """One embedding per input, as floats or base64."""
    return await create_embedding(request, _state(request))


__all__ = ["EmbeddingRequest", "create_embedding", "embedding_routes", "encode_embedding", "pool", "prompts_of"]
