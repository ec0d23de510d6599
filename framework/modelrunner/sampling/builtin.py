"""The kernel's logits processors, applied from :class:`~.params.SamplingParams` fields: penalties,
``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens`` and vLLM 0.x callables.

Each runs once per step over all rows that use it; only ``bad_words`` and the legacy callables
touch rows one at a time (their rules depend on each row's own recent tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from .logits_processor import LogitsProcessor, LogitsRow, banned_mask, token_counts
from .params import SamplingParams


def _check_ids(field: str, ids: Sequence[int], vocab: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{field} names token id {bad}, outside the vocabulary (accepted: 0 … {vocab - 1})")


class BuiltinProcessor(LogitsProcessor):
    """A processor the kernel applies from the :class:`SamplingParams` fields it names in ``fields``."""

    builtin = True
    fields: ClassVar[tuple[str, ...]] = ()
    """The :class:`SamplingParams` fields this processor implements."""


class PenaltiesProcessor(BuiltinProcessor):
    """``repetition_penalty`` over prompt and output, ``presence_penalty`` / ``frequency_penalty`` over
    the output, with vLLM's semantics."""

    name, order = "penalties", 10
    example_args = ({"repetition_penalty": 1.3}, {"presence_penalty": 0.5, "frequency_penalty": 0.3})
    invalid_args = ({"repetition_penalty": 0}, {"presence_penalty": 5}, {"frequency_penalty": -3})
    fields = ("repetition_penalty", "presence_penalty", "frequency_penalty")

    def request_state(self, params: SamplingParams, args: dict[str, Any]) -> Any:
        on = params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        return True if on else None

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        vocab, device = logits.shape[1], logits.device
        outputs = token_counts([r.output_token_ids for r in rows], vocab, device)
        repetition = torch.tensor([r.params.repetition_penalty for r in rows], device=device).unsqueeze(1)
        if bool((repetition != 1.0).any()):
            seen = token_counts([r.prompt_token_ids for r in rows], vocab, device).add_(outputs) > 0
            scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
            logits = torch.where(seen, scaled, logits)
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device).unsqueeze(1)
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=device).unsqueeze(1)
        return logits - frequency * outputs - presence * (outputs > 0).float()


class LogitBiasProcessor(BuiltinProcessor):
    """``logit_bias``: a per-token bias added to the logits."""

    name, order = "logit_bias", 20
    example_args = ({"logit_bias": {5: 2.0, 7: -100.0}}, {"logit_bias": {9: 1.5}})
    invalid_args = ({"logit_bias": {999: 1.0}},)
    fields = ("logit_bias",)

    def request_state(self, params: SamplingParams, args: dict[str, Any]) -> Any:
        if not params.logit_bias:
            return None
        _check_ids("logit_bias", list(params.logit_bias), self.context.vocab_size)
        return (list(params.logit_bias), [float(b) for b in params.logit_bias.values()])

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        index = [(r, t, b) for r, row in enumerate(rows) for t, b in zip(*row.state)]
        r, t, b = zip(*index)
        logits.index_put_((torch.tensor(r), torch.tensor(t)), torch.tensor(b, dtype=logits.dtype), accumulate=True)
        return logits


class AllowedTokensProcessor(BuiltinProcessor):
    """``allowed_token_ids``: every other token's logit becomes -inf."""

    name, order = "allowed_token_ids", 30
    example_args = ({"allowed_token_ids": [3, 4, 5, 6]}, {"allowed_token_ids": [8]})
    invalid_args = ({"allowed_token_ids": [3, 999]},)
    fields = ("allowed_token_ids",)

    def request_state(self, params: SamplingParams, args: dict[str, Any]) -> Any:
        if params.allowed_token_ids is None:
            return None
        _check_ids("allowed_token_ids", params.allowed_token_ids, self.context.vocab_size)
        return params.allowed_token_ids

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        allowed = banned_mask(len(rows), logits.shape[1], [r.state for r in rows], logits.device)
        return logits.masked_fill_(~allowed, float("-inf"))


class BadWordsProcessor(BuiltinProcessor):
    """``bad_words``: each word is tokenized as it would appear alone and after a space; a one-token
    word is always banned, a longer one's last token is banned right after its other tokens."""

    name, order = "bad_words", 40
    example_args = ({"bad_words": ["t5", "t9 t10"]},)
    invalid_args = ({"bad_words": [""]},)
    fields = ("bad_words",)

    def request_state(self, params: SamplingParams, args: dict[str, Any]) -> Any:
        if not params.bad_words:
            return None
        tokenizer = self.context.tokenizer
        if tokenizer is None:
            raise ValueError("bad_words needs a tokenizer, and this model has none")
        sequences: set[tuple[int, ...]] = set()
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    sequences.add(ids)
        return sorted(sequences)

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        banned: list[list[int]] = []
        for row in rows:
            out = row.output_token_ids
            mine = []
            for ids in row.state:
                prefix = ids[:-1]
                if not prefix or (len(out) >= len(prefix) and tuple(out[len(out) - len(prefix):]) == prefix):
                    mine.append(ids[-1])
            banned.append(mine)
        return logits.masked_fill_(banned_mask(len(rows), logits.shape[1], banned, logits.device), float("-inf"))


class MinTokensProcessor(BuiltinProcessor):
    """``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` cannot be sampled before it."""

    name, order = "min_tokens", 50
    example_args = ({"min_tokens": 3, "stop_token_ids": [7]}, {"min_tokens": 1})
    invalid_args = ({"min_tokens": -1},)
    fields = ("min_tokens",)

    def request_state(self, params: SamplingParams, args: dict[str, Any]) -> Any:
        if params.min_tokens <= 0:
            return None
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.context.eos_token_ids))
        return sorted(banned) or None

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        banned = [r.state if len(r.output_token_ids) < r.params.min_tokens else [] for r in rows]
        return logits.masked_fill_(banned_mask(len(rows), logits.shape[1], banned, logits.device), float("-inf"))


class LegacyCallablesProcessor(BuiltinProcessor):
    """vLLM 0.x logits processors given as callables in ``logits_processors``:
    ``fn(output_token_ids, logits_row) -> logits_row``, applied row by row in the order given."""

    name, order = "callables", 90
    example_args = ({"logits_processors": [lambda output_token_ids, logits: logits.mul_(0.5)]},)
    fields = ()

    def request_state(self, params: SamplingParams, args: dict[str, Any]) -> Any:
        fns = [p for p in params.logits_processors if callable(p)]
        return fns or None

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        for r, row in enumerate(rows):
            for fn in row.state:
                out = fn(list(row.output_token_ids), logits[r])
                if not isinstance(out, torch.Tensor) or out.shape != logits[r].shape:
                    raise ValueError(f"logits processor {getattr(fn, '__name__', fn)!r} returned "
                                     f"{getattr(out, 'shape', type(out).__name__)}, expected a tensor of shape "
                                     f"{tuple(logits[r].shape)}")
                logits[r] = out
        return logits


BUILTIN_PROCESSORS = (PenaltiesProcessor, LogitBiasProcessor, AllowedTokensProcessor, BadWordsProcessor,
                      MinTokensProcessor, LegacyCallablesProcessor)
"""The kernel's processors, in the order they run."""
BUILTIN_FIELDS = frozenset(f for p in BUILTIN_PROCESSORS for f in p.fields)
"""The :class:`SamplingParams` fields the kernel's processors implement."""
