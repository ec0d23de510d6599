"""Append a sampled token to a sequence and decide whether the sequence ends (vLLM's StopChecker)."""

from __future__ import annotations

from typing import Any

from .detokenizer import detokenize_incrementally, truncate_at_stop_string
from .sequence import Sequence


class StopChecker:
    """Applies, in order: EOS (unless ``ignore_eos``), ``stop_token_ids``, stop strings (text cut
    before them), ``max_tokens`` and ``max_model_len``. Stop tokens stay in ``token_ids`` but are
    not detokenized. ``min_tokens`` is enforced earlier, by masking those tokens' logits."""

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
        search_from = detokenize_incrementally(self.tokenizer, seq)
        if params.stop:
            found = truncate_at_stop_string(seq, search_from)
            if found is not None:
                return "stop", found
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None


def eos_token_ids(tokenizer: Any, hf_config: Any) -> frozenset[int]:
    """The tokenizer's EOS plus every ``eos_token_id`` of the model config (which may be a list)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    eos = getattr(text, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(t) for t in eos)
    return frozenset(ids)
