"""Logits processors: a plugin kind that edits the next-token logits of the requests that use it.

The engine calls each processor once per step with the logits rows of every request that uses it,
never once per request. Built-in processors (penalties, biases, masks, ``min_tokens``) apply when a
request sets their :class:`~.params.SamplingParams` field; the others when a request names them
(``SamplingParams(logits_processors=["name", ("name", {"arg": 1})])``). A plugin declares one
with ``registry.logits_processors(MyProcessor)``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from .params import SamplingParams


@attrs.frozen
class ProcessorContext:
    """What a processor knows of the model it serves (given once, when the engine creates it)."""

    vocab_size: int
    """Columns of the logits."""
    tokenizer: Any
    """The checkpoint's tokenizer (None for a model without one)."""
    eos_token_ids: frozenset[int]
    """Token ids that end a completion unless ``ignore_eos``."""


@attrs.frozen
class LogitsRow:
    """One logits row a processor edits: whose it is and what that sequence holds so far."""

    state: Any
    """What the processor's :meth:`LogitsProcessor.request_state` returned for this request."""
    params: SamplingParams
    """The request's sampling parameters."""
    prompt_token_ids: Sequence[int]
    """The request's prompt."""
    output_token_ids: Sequence[int]
    """The tokens this completion generated so far (the row's logits choose the next one)."""


class LogitsProcessor(abc.ABC):
    """Edits the logits of the rows whose requests use it, in one call per step.

    :param context: the model's vocabulary size, tokenizer and EOS ids.
    """

    name: ClassVar[str] = "?"
    """Registry name; requests name it in ``SamplingParams.logits_processors``."""
    builtin: ClassVar[bool] = False
    """True for the kernel's processors that apply from :class:`~.params.SamplingParams` fields
    (a request never names them)."""
    order: ClassVar[int] = 100
    """Processors run in ascending order (built-ins 10–90, named ones after, then sampling)."""
    example_args: ClassVar[tuple[dict[str, Any], ...]] = ()
    """Requests that use this processor, for its conformance suite (``modelrunner check``): for a named
    processor, ``args`` dicts a request may give with its name; for a built-in one, the
    :class:`~.params.SamplingParams` keyword arguments that turn it on (token ids below 256, the suite's
    tiny vocabulary). Empty: the suite skips the checks that need a request."""
    invalid_args: ClassVar[tuple[dict[str, Any], ...]] = ()
    """Arguments, in the form of :attr:`example_args`, that must be refused with a ``ValueError`` naming each key."""

    def __init__(self, context: ProcessorContext) -> None:
        self.context = context
        """The model this processor serves."""

    def request_state(self, params: SamplingParams, args: dict[str, Any]) -> Any:
        """Called once when a request is added: the state :meth:`apply` gets for its rows, or None
        when the request does not use this processor.

        The default returns ``args`` (a named processor is used by every request naming it).
        Raise ``ValueError`` naming the bad argument to reject the request; nothing is queued then.

        :param params: the request's (validated) sampling parameters.
        :param args: the arguments the request gave with this processor's name (``{}`` for built-ins).
        """
        return args

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        """The edited logits ``[len(rows), vocab]`` (editing ``logits`` in place and returning it is fine),
        of ``logits``' shape and dtype; -inf masks a token. Anything else — another shape or dtype, NaN
        or +inf — fails the request whose row holds it, naming this processor. Work that depends only on
        the request (masks, tensors, lookup tables) belongs in :meth:`request_state`, done once.

        :param logits: float32 logits of the rows that use this processor, in ``rows``' order.
        :param rows: who each row belongs to and what it generated so far.
        """

    def __repr__(self) -> str:
        return f"<logits processor {self.name!r}>"


def banned_mask(rows: int, vocab: int, banned: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """A ``[rows, vocab]`` boolean mask, True at each row's banned token ids (ids past ``vocab`` ignored)."""
    mask = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
    pairs = [(r, t) for r, ids in enumerate(banned) for t in ids if 0 <= t < vocab]
    if pairs:
        index = torch.tensor(pairs, dtype=torch.long, device=device)
        mask[index[:, 0], index[:, 1]] = True
    return mask


def token_counts(sequences: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(sequences), vocab]`` float32 counts of each token id in each sequence, by one scatter-add."""
    counts = torch.zeros(len(sequences), vocab, dtype=torch.float32, device=device)
    longest = max((len(s) for s in sequences), default=0)
    if longest == 0:
        return counts
    ids = torch.full((len(sequences), longest), vocab, dtype=torch.long)
    for r, seq in enumerate(sequences):
        if seq:
            ids[r, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    ids = ids.clamp_(max=vocab).to(device)  # out-of-vocabulary ids land in a dropped column
    padded = torch.zeros(len(sequences), vocab + 1, dtype=torch.float32, device=device)
    padded.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    counts.copy_(padded[:, :vocab])
    return counts
