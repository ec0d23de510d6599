"""Append a sampled token to a sequence and decide whether the sequence ends (vLLM's StopChecker)."""

from __future__ import annotations

from typing import Any

from .detokenizer import detokenize_incrementally, truncate_at_stop_string
from .sequence import Sequence


class StopChecker:
    """Applies, in order: EOS (unless ``ignore_eos``), ``stop_token_ids``, stop strings (text cut
    before them unless ``include_stop_str_in_output``), ``max_tokens`` and ``max_model_len``. Stop
    tokens stay in ``token_ids`` but are not detokenized. ``min_tokens`` is enforced earlier, by a
    logits processor that masks those tokens. Without a tokenizer (or with ``detokenize=False``) no
    text is produced."""

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        """Detokenizes the new tokens."""
        self.eos_token_ids = eos_token_ids
        """Token ids that end a completion unless ``ignore_eos``."""
        self.max_model_len = max_model_len
        """A sequence this long ends with ``"length"``."""

    def append_token(self, seq: Sequence, token: int) -> tuple[str, int | str | None] | None:
        """Append ``token`` (and its text) to ``seq``.

        :returns: ``(finish_reason, stop_reason)`` when the sequence must end, else None.
        """
        seq.token_ids.append(token)
        params = seq.params
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if params.detokenize and self.tokenizer is not None:
            search_from = detokenize_incrementally(self.tokenizer, seq)
            if params.stop:
                found = truncate_at_stop_string(seq, search_from, keep=params.include_stop_str_in_output)
                if found is not None:
                    return "stop", found
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None
