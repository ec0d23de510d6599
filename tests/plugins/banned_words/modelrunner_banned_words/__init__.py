"""A third-party logits processor, as an outsider writes one: ``banned_words``.

A request uses it with ``SamplingParams(logits_processors=[("banned_words", {"words": ["Paris"]})])``
(or ``{"token_ids": [...]}``): the first token of each word (alone and after a space) and every
listed token id can never be sampled for that request. The engine calls :meth:`apply` once per
step with the rows of every request that named it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from modelrunner import hookimpl
from modelrunner.sampling import LogitsProcessor, LogitsRow, banned_mask


class BannedWords(LogitsProcessor):
    """Bans the first token of each of ``words`` and every id in ``token_ids``."""

    name = "banned_words"
    example_args = ({"words": ["t5"]}, {"token_ids": [9, 10]})
    invalid_args = ({"token_ids": [999]}, {"words": [""]}, {"colour": "red"})

    def request_state(self, params: Any, args: dict[str, Any]) -> list[int]:
        unknown = set(args) - {"words", "token_ids"}
        if unknown:
            raise ValueError(f"banned_words takes 'words' and 'token_ids', got {sorted(unknown)}")
        words, ids = args.get("words", []), list(args.get("token_ids", []))
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w for w in words):
            raise ValueError(f"banned_words: words must be a list of non-empty strings, got {words!r}")
        vocab = self.context.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"banned_words: token_ids must be ids in [0, {vocab}), got {ids!r}")
        tokenizer = self.context.tokenizer
        for word in words:
            for text in (word, " " + word):
                encoded = tokenizer.encode(text, add_special_tokens=False)
                if encoded:
                    ids.append(encoded[0])
        return sorted(set(ids))

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        mask = banned_mask(len(rows), logits.shape[1], [row.state for row in rows], logits.device)
        return logits.masked_fill_(mask, float("-inf"))


@hookimpl
def register(registry: Any) -> None:
    """Declare the processor; requests name it in ``SamplingParams.logits_processors``."""
    registry.logits_processors(BannedWords)
