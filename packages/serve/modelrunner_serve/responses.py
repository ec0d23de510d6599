"""The parts of OpenAI's responses both endpoints build: usage, and log-probabilities in the
completions format (``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``) and the chat
format (``content: [{token, logprob, bytes, top_logprobs}]``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from modelrunner.engine.outputs import Logprob, PositionLogprobs

MIN_LOGPROB = -9999.0
"""Log-probabilities are clamped here: JSON has no -Infinity (vLLM clamps to the same value)."""


def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-3f2a…``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """The ``created`` timestamp: seconds since the epoch."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def clamp(logprob: float) -> float:
    """``logprob`` made JSON-safe (no -inf, no NaN)."""
    return max(logprob, MIN_LOGPROB)


def _token_text(tokenizer: Any, token_id: int, entry: Logprob | None, as_ids: bool = False) -> str:
    if as_ids:  # vLLM's return_tokens_as_token_ids: names that survive tokens that are not whole characters
        return f"token_id:{token_id}"
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def _by_rank(position: PositionLogprobs) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda item: (item[1].rank is None, item[1].rank or 0))


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None], tokenizer: Any,
                        text_offset: int = 0, as_ids: bool = False) -> tuple[dict[str, Any], int]:
    """Log-probabilities in the completions format, and the text offset after the last token.

    :param positions: per token, its log-probability entry (None for a prompt's first token,
        which nothing predicts: its ``token_logprobs`` and ``top_logprobs`` are null).
    :param text_offset: where the first token starts in the returned text.
    :param as_ids: name tokens ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``).
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position is not None else None
        text = _token_text(tokenizer, token_id, chosen, as_ids)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if position is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clamp(chosen.logprob) if chosen is not None else None)
        top_logprobs.append({_token_text(tokenizer, tid, lp, as_ids): clamp(lp.logprob)
                             for tid, lp in _by_rank(position)})
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
             "text_offset": offsets}, text_offset)


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int,
                  tokenizer: Any, as_ids: bool = False) -> dict[str, Any]:
    """Log-probabilities in the chat format: per token, its own and the ``top_n`` likeliest (named
    ``token_id:<id>`` with ``as_ids``, vLLM's ``return_tokens_as_token_ids``)."""
    def entry(token_id: int, lp: Logprob) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id, lp, as_ids)
        return {"token": text, "logprob": clamp(lp.logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) or Logprob(MIN_LOGPROB)
        item = entry(token_id, chosen)
        item["top_logprobs"] = [entry(tid, lp) for tid, lp in _by_rank(position)
                                if lp.rank is not None and lp.rank <= top_n]
        content.append(item)
    return {"content": content}


def prompt_logprobs_json(positions: Sequence[PositionLogprobs | None] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, null or ``{token_id: {logprob, rank, decoded_token}}``."""
    if positions is None:
        return None
    return [None if p is None else {str(tid): {"logprob": clamp(lp.logprob), "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for tid, lp in _by_rank(p)}
            for p in positions]
