"""The kernel's logits processors, applied from :class:`~.params.SamplingParams` fields: penalties,
``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens`` and vLLM 0.x callables.

Each runs once per step over all rows that use it; only ``bad_words`` and the legacy callables
touch rows one at a time (their rules depend on each row's own recent tokens). What a request's
fields ask for is turned into masks, tensors and lookup tables once, when the request is added, so a
step's cost does not grow with the size of those fields (one request with a whole-vocabulary
``logit_bias`` costs the others no more than one with a single entry).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch

from .logits_processor import LogitsProcessor, LogitsRow, banned_mask, token_counts
from .params import SamplingParams


def _check_ids(field: str, ids: Sequence[int], vocab: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{field} names token id {bad}, outside the vocabulary (accepted: 0 … {vocab - 1})")


class RequestTensors:
    """Tensors built once for a request (on the CPU), copied once to each device whose logits use them."""

    __slots__ = ("_copies",)

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._copies: dict[torch.device, tuple[torch.Tensor, ...]] = {torch.device("cpu"): tensors}

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The tensors on ``device``."""
        found = self._copies.get(device)
        if found is None:
            found = self._copies[device] = tuple(t.to(device) for t in self._copies[torch.device("cpu")])
        return found


def token_mask(ids: Iterable[int], vocab: int) -> torch.Tensor:
    """A ``[vocab]`` boolean CPU mask, True at ``ids`` (ids outside the vocabulary ignored)."""
    mask = torch.zeros(vocab, dtype=torch.bool)
    index = torch.as_tensor(list(ids), dtype=torch.long)
    mask[index[(index >= 0) & (index < vocab)]] = True
    return mask


def _stack_masks(rows: Sequence[torch.Tensor | None], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(rows), vocab]`` bool: each row's mask, all False where it has None."""
    out = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for r, mask in enumerate(rows):
        if mask is not None:
            out[r] = mask
    return out


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
        return RequestTensors(torch.tensor(list(params.logit_bias), dtype=torch.long),
                              torch.tensor([float(b) for b in params.logit_bias.values()], dtype=torch.float32))

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        for r, row in enumerate(rows):
            ids, bias = row.state.on(logits.device)
            logits[r].index_add_(0, ids, bias.to(logits.dtype))
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
        return RequestTensors(token_mask(params.allowed_token_ids, self.context.vocab_size))

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        allowed = _stack_masks([r.state.on(logits.device)[0] for r in rows], logits.shape[1], logits.device)
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
        return BadWordsState(sorted(sequences), self.context.vocab_size)

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        vocab, device = logits.shape[1], logits.device
        banned = _stack_masks([r.state.always.on(device)[0] for r in rows], vocab, device)
        after = [r.state.banned_after(r.output_token_ids) for r in rows]
        if any(after):
            banned |= banned_mask(len(rows), vocab, after, device)
        return logits.masked_fill_(banned, float("-inf"))


class BadWordsState:
    """A request's ``bad_words`` as token sequences, ready for each step: the one-token words as a
    mask, the longer ones in a trie of their leading tokens read backwards, so finding what the
    latest output bans walks at most the longest word's length, however many words there are.

    :param sequences: the token sequences to never complete.
    :param vocab: the vocabulary size (columns of the one-token mask).
    """

    __slots__ = ("always", "trie", "depth")

    def __init__(self, sequences: Iterable[tuple[int, ...]], vocab: int) -> None:
        single: set[int] = set()
        self.trie: dict[int, Any] = {}
        """Leading tokens, latest first → deeper nodes; key -1 holds the tokens banned after them."""
        self.depth = 0
        """Longest path in :attr:`trie` (the most tokens looked at per step)."""
        for ids in sequences:
            if len(ids) == 1:
                single.add(ids[0])
                continue
            node = self.trie
            for token in reversed(ids[:-1]):
                node = node.setdefault(token, {})
            node.setdefault(-1, []).append(ids[-1])
            self.depth = max(self.depth, len(ids) - 1)
        self.always = RequestTensors(token_mask(single, vocab))
        """Tokens banned at every step (the one-token words)."""

    def banned_after(self, output: Sequence[int]) -> list[int]:
        """The last tokens of the words whose other tokens ``output`` ends with."""
        banned: list[int] = []
        node = self.trie
        for k in range(len(output) - 1, max(len(output) - 1 - self.depth, -1), -1):
            node = node.get(output[k])
            if node is None:
                break
            banned += node.get(-1, ())
        return banned


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
        return RequestTensors(token_mask(banned, self.context.vocab_size)) if banned else None

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        device = logits.device
        banned = [r.state.on(device)[0] if len(r.output_token_ids) < r.params.min_tokens else None for r in rows]
        return logits.masked_fill_(_stack_masks(banned, logits.shape[1], device), float("-inf"))


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
                problem = _row_problem(out, logits[r])
                if problem is not None:
                    raise ValueError(f"logits processor {getattr(fn, '__name__', fn)!r} returned {problem}")
                logits[r] = out
        return logits


def _row_problem(out: Any, row: torch.Tensor) -> str | None:
    """What is wrong with ``out`` as a replacement for logits ``row``, or None."""
    if not isinstance(out, torch.Tensor):
        return f"a {type(out).__name__}, expected a tensor of shape {tuple(row.shape)}"
    if out.shape != row.shape:
        return f"shape {tuple(out.shape)}, expected {tuple(row.shape)}"
    if out.dtype != row.dtype:
        return f"{str(out.dtype).removeprefix('torch.')} logits, expected {str(row.dtype).removeprefix('torch.')}"
    nan, posinf = int(torch.isnan(out).sum()), int(torch.isposinf(out).sum())
    if nan or posinf:
        what = " and ".join(p for p in (f"NaN in {nan}" if nan else "", f"+inf in {posinf}" if posinf else "") if p)
        return f"{what} of {row.shape[0]} logits"
    return None


BUILTIN_PROCESSORS = (PenaltiesProcessor, LogitBiasProcessor, AllowedTokensProcessor, BadWordsProcessor,
                      MinTokensProcessor, LegacyCallablesProcessor)
"""The kernel's processors, in the order they run."""
BUILTIN_FIELDS = frozenset(f for p in BUILTIN_PROCESSORS for f in p.fields)
"""The :class:`SamplingParams` fields the kernel's processors implement."""
