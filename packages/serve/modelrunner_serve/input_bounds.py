"""Cheap bounds on a conversation, checked before anything is tokenized.

Tokenizing megabytes of text takes seconds and gigabytes only to learn that the prompt cannot fit
the context. A token stands for at most as many characters as the tokenizer's longest vocabulary
entry (byte-level BPE spells each byte as one character, so its longest entry bounds the bytes, and
a text has at least as many bytes as characters), so a text of ``n`` characters needs at least
``n / longest`` tokens; :data:`NORMALIZER_SLACK` leaves room for normalizers that merge characters.
Each input item renders to at least one token, and a request may hold at most ``--max-input-items``.
"""

from __future__ import annotations

import math
import threading
from typing import Any

from .errors import bad_request

NORMALIZER_SLACK = 4
"""Factor on the longest token's length in the lower bound on a text's tokens (a normalizer may
merge up to this many characters into one before tokenizing)."""

_LONGEST: dict[int, tuple[Any, int]] = {}
_LOCK = threading.Lock()


def longest_token_chars(tokenizer: Any) -> int:
    """The length, in characters, of ``tokenizer``'s longest vocabulary entry (added tokens included),
    computed once per tokenizer (tens of milliseconds: call it off the event loop the first time)."""
    key = id(tokenizer)
    with _LOCK:
        found = _LONGEST.get(key)
    if found is not None:
        return found[1]
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=1)
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: no bound from it
        longest = 0
    with _LOCK:
        _LONGEST[key] = (tokenizer, longest)  # the tokenizer kept alive, so its id is not reused
    return longest


def min_tokens(chars: int, tokenizer: Any) -> int:
    """The fewest tokens a text of ``chars`` characters can take (0 when the tokenizer gives no bound)."""
    longest = longest_token_chars(tokenizer) if tokenizer is not None else 0
    return math.ceil(chars / (longest * NORMALIZER_SLACK)) if longest else 0


def text_chars(value: Any) -> int:
    """Characters of text the chat template renders from ``value`` (Responses ``input``: a string, or
    message, ``function_call`` and ``function_call_output`` items), counting only what is surely
    rendered: contents, text parts, calls' names and arguments, outputs."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, list):
        return 0
    total = 0
    for item in value:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "function_call":
            total += sum(len(item[k]) for k in ("name", "arguments") if isinstance(item.get(k), str))
        else:
            total += _content_chars(item.get("output" if kind == "function_call_output" else "content"))
    return total


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    return sum(len(part[k]) for part in content if isinstance(part, dict)
               for k in ("text", "refusal") if isinstance(part.get(k), str))


def check_input_bounds(value: Any, instructions: str | None, tokenizer: Any, max_model_len: int,
                       max_items: int, param: str = "input") -> None:
    """Refuse, without tokenizing, a conversation that can never fit the context or has too many items.

    :param value: the request's ``input`` (a string or a list of items).
    :param instructions: the system text put before it (None: none).
    :param max_items: the most items accepted (``--max-input-items``).
    :raises APIError: 400 naming ``param``: more items than ``max_items`` or than the context has
        tokens, or more text than ``max_model_len`` tokens can hold.
    """
    items = len(value) if isinstance(value, list) else 1
    if items > max_items:
        raise bad_request(f"{param} has {items} items; accepted: at most {max_items} (--max-input-items)",
                          param=param, code="too_many_items")
    if items > max_model_len:
        raise bad_request(f"{param} has {items} items, each at least one token, and this model's maximum context "
                          f"length is {max_model_len} tokens", param=param, code="context_length_exceeded")
    chars = text_chars(value) + (len(instructions) if isinstance(instructions, str) else 0)
    needed = min_tokens(chars, tokenizer)
    if needed > max_model_len:
        raise bad_request(f"{param} is too long: its {chars} characters of text take at least {needed} tokens, and "
                          f"this model's maximum context length is {max_model_len} tokens", param=param,
                          code="context_length_exceeded")


__all__ = ["NORMALIZER_SLACK", "check_input_bounds", "longest_token_chars", "min_tokens", "text_chars"]
