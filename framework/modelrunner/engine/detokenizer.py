"""Incremental detokenization and stop strings: the text side of a sequence's output."""

from __future__ import annotations

from typing import Any

from .sequence import Sequence

INITIAL_CONTEXT_TOKENS = 5
"""Prompt tokens decoded as context before the first generated token (spaces and merges depend on it)."""


def start_detokenizer(seq: Sequence) -> None:
    """Point the sequence's detokenizer window at the end of its prompt."""
    seq.read_offset = seq.prompt_len
    seq.prefix_offset = max(seq.prompt_len - INITIAL_CONTEXT_TOKENS, 0)


def detokenize_incrementally(tokenizer: Any, seq: Sequence) -> int:
    """Append the text of the sequence's newest tokens to ``seq.output_text``.

    Decodes only a small window (a few context tokens plus the unread ones), so the cost per step
    does not grow with the sequence. Text is held back while it ends in an incomplete UTF-8
    character (decoded as U+FFFD), and released once the following token completes it.

    :returns: the length ``output_text`` had before, where a stop-string search may start.
    """
    before = len(seq.output_text)
    ids = seq.token_ids
    skip = seq.params.skip_special_tokens
    decode = _fast_decode(tokenizer)
    prefix_text = decode(ids[seq.prefix_offset:seq.read_offset], skip)
    full_text = decode(ids[seq.prefix_offset:], skip)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        seq.output_text += full_text[len(prefix_text):]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
    return before


def _fast_decode(tokenizer: Any) -> Any:
    """``decode(ids, skip_special_tokens)`` without transformers' per-call conversions when the
    tokenizer has a Rust backend (it runs for every sequence at every step)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def text_delta(seq: Sequence, hold_back: int | None = None) -> str:
    """Text not yet reported, holding back a tail that could still become a stop string.

    :param hold_back: the longest stop string's length (None: computed from ``seq.params.stop``).
    """
    end = len(seq.output_text)
    if not seq.is_finished and seq.params.stop:
        end -= (max(len(s) for s in seq.params.stop) if hold_back is None else hold_back) - 1
    if end <= seq.sent_text_len:
        return ""
    delta = seq.output_text[seq.sent_text_len:end]
    seq.sent_text_len = end
    return delta
