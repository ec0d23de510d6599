"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from modelrunner.engine.input_processor import check_unicode
from .chat import ChatOptions, parse_messages, render
from .errors import bad_request
from .protocol import DetokenizeRequest, TokenizeRequest, parse_body
from .state import ServerState


async def tokenize(request: Request, state: ServerState) -> dict[str, Any]:
    """``{"prompt": ...}`` or ``{"messages": [...]}`` → ``{"count", "max_model_len", "tokens", "token_strs"}``.

    :raises APIError: 400 unless exactly one of ``prompt`` and ``messages`` is given, or for bad messages.
    """
    body = await parse_body(request, TokenizeRequest)
    served = state.require_model()
    state.check_model_name(body.model)
    _require_tokenizer(served.tokenizer)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt (text) and messages (a conversation)", param="prompt")
    if body.prompt is not None:
        try:
            check_unicode("prompt", body.prompt)
        except ValueError as e:
            raise bad_request(str(e), param="prompt") from None
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await run_in_threadpool(served.tokenizer.encode, body.prompt, add_special_tokens=add_special)
    else:
        options = ChatOptions.from_request(body, state.settings)
        parsed = parse_messages(body.messages, served.image_token)
        prompt = await run_in_threadpool(render, served.llm, served.tokenizer, parsed, options)
        ids = prompt["prompt_token_ids"]
    ids = list(ids)
    return {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids,
            "token_strs": served.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}


async def detokenize(request: Request, state: ServerState) -> dict[str, Any]:
    """``{"tokens": [ids]}`` → ``{"prompt": text}``.

    :raises APIError: 400 for token ids outside the vocabulary.
    """
    body = await parse_body(request, DetokenizeRequest)
    served = state.require_model()
    state.check_model_name(body.model)
    _require_tokenizer(served.tokenizer)
    vocab = served.llm.engine.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens[{bad}] is {body.tokens[bad]}, not a token id (accepted: 0 … {vocab - 1})",
                          param=f"tokens[{bad}]")
    return {"prompt": await run_in_threadpool(served.tokenizer.decode, body.tokens)}


def _require_tokenizer(tokenizer: Any) -> None:
    if tokenizer is None:
        raise bad_request("this checkpoint ships no tokenizer, so the server cannot tokenize or detokenize",
                          code="unsupported")
