"""Append a sampled token to a sequence and decide whether the sequence ends (vLLM's StopChecker)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq
from typing import Any

from .detokenizer import detokenize_incrementally
from .sequence import Request, Sequence


class StopStrings:
    """A request's stop strings in a trie of their characters read backwards, built once per request:
    finding those that end in a step's new text walks back from each new character at most the
    longest stop string's length, however many stop strings there are.

    :param stops: the stop strings, in the request's order (the first wins a tie).
    """

    __slots__ = ("stops", "trie", "longest")

    def __init__(self, stops: Seq[str]) -> None:
        self.stops = tuple(stops)
        """The stop strings."""
        self.longest = max((len(s) for s in self.stops), default=0)
        """The longest one's length (no match can start further back than this from its end)."""
        self.trie: dict[str, Any] = {}
        """Characters, last first → deeper nodes; key ``""`` holds the index of the string ending there."""
        for index, stop in enumerate(self.stops):
            node = self.trie
            for char in reversed(stop):
                node = node.setdefault(char, {})
            node.setdefault("", index)

    def find(self, text: str, search_from: int) -> tuple[int, str] | None:
        """The earliest stop string in ``text`` that ends after ``search_from`` (its start, itself),
        or None. Among those starting at the same place the first in the request's order wins.

        :param search_from: characters before this were already searched.
        """
        best: tuple[int, int] | None = None
        for end in range(max(search_from, 0) + 1, len(text) + 1):
            node = self.trie
            for k in range(end - 1, max(end - 1 - self.longest, -1), -1):
                node = node.get(text[k])
                if node is None:
                    break
                index = node.get("")
                if index is not None and (best is None or (k, index) < best):
                    best = (k, index)
        return None if best is None else (best[0], self.stops[best[1]])


class _RequestStops:
    """What ends a request, prepared once: its stop token ids as a set, its stop strings as a trie."""

    __slots__ = ("token_ids", "strings")

    def __init__(self, params: Any) -> None:
        self.token_ids = frozenset(params.stop_token_ids)
        self.strings = StopStrings(params.stop) if params.stop else None


class StopChecker:
    """Applies, in order: EOS (unless ``ignore_eos``), ``stop_token_ids``, stop strings (text cut
    before them unless ``include_stop_str_in_output``), ``max_tokens`` and ``max_model_len``. Stop
    tokens stay in ``token_ids`` but are not detokenized. ``min_tokens`` is enforced earlier, by a
    logits processor that masks those tokens. Without a tokenizer (or with ``detokenize=False``) no
    text is produced. A request's stop ids and strings are prepared at its first token, so a step's
    cost does not grow with how many it has."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        """Detokenizes the new tokens."""
        self.eos_token_ids = eos_token_ids
        """Token ids that end a completion unless ``ignore_eos``."""
        self.max_model_len = max_model_len
        """A sequence this long ends with ``"length"``."""
        self._prepared: weakref.WeakKeyDictionary[Request, _RequestStops] = weakref.WeakKeyDictionary()

    def _stops(self, request: Request) -> _RequestStops:
        found = self._prepared.get(request)
        if found is None:
            found = self._prepared[request] = _RequestStops(request.params)
        return found

    def longest_stop_string(self, seq: Sequence) -> int:
        """The length of ``seq``'s longest stop string (0 without any): how much text streaming holds back."""
        strings = self._stops(seq.request).strings
        return 0 if strings is None else strings.longest

    def append_token(self, seq: Sequence, token: int) -> tuple[str, int | str | None] | None:
        """Append ``token`` (and its text) to ``seq``.

        :returns: ``(finish_reason, stop_reason)`` when the sequence must end, else None.
        """
        seq.token_ids.append(token)
        params = seq.params
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop", None
        stops = self._stops(seq.request)
        if token in stops.token_ids:
            return "stop", token
        if params.detokenize and self.tokenizer is not None:
            search_from = detokenize_incrementally(self.tokenizer, seq)
            if stops.strings is not None:
                found = stops.strings.find(seq.output_text, search_from)
                if found is not None:
                    at, stop = found
                    seq.output_text = seq.output_text[:at + (len(stop) if params.include_stop_str_in_output else 0)]
                    return "stop", stop
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None
