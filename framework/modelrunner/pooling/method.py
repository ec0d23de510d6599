"""Pooling methods: a plugin kind that turns a prompt's final hidden states into one embedding.

The engine runs an embedding request like a prompt that generates nothing: every prompt token goes
through the model (in chunks, beside other requests' steps), and the hidden states after the final
norm of the rows the method :attr:`~PoolingMethod.reads` are kept. When the prompt is done the
method pools them into one vector; the kernel then truncates it to the request's ``dimensions``
(Matryoshka) and L2-normalises it when asked (vLLM's pooler head). A plugin declares one with
``registry.pooling_methods(MyMethod)``; ``LLM(model, pooling_type="name")`` picks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

READS = ("all", "first", "last")
"""What a method may read: every prompt token's row, the first token's, or the last token's."""


@attrs.frozen
class PoolingContext:
    """What a pooling method knows of the model it serves (given once, when the engine creates it)."""

    hidden_size: int
    """Width of the hidden states it pools."""
    tokenizer: Any = None
    """The checkpoint's tokenizer (None for a model without one)."""
    hf_config: Any = None
    """The checkpoint's transformers config."""


class PoolingMethod:
    """Pools one prompt's final hidden states into one vector (subclass and register with
    ``registry.pooling_methods(cls)``; chosen by the ``pooling_type`` config field).

    :param context: the model's hidden size, tokenizer and config.
    """

    name: ClassVar[str] = ""
    """The name the method registers under (``pooling_type``)."""
    reads: ClassVar[str] = "all"
    """Which rows :meth:`pool` gets (one of :data:`READS`): ``"all"`` every prompt token's, in order;
    ``"first"`` / ``"last"`` only the first / last token's (the engine then keeps nothing else, and a
    ``"last"`` method lets prompts share cached prefixes)."""

    def __init__(self, context: PoolingContext) -> None:
        self.context = context
        """The model this method serves."""

    def pool(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        """One prompt's embedding, before truncation and normalisation.

        :param hidden: float32 ``[rows, hidden_size]`` on the CPU: every prompt token's final hidden
            state (``reads == "all"``), or the single row it reads. Do not modify it.
        :param token_ids: the prompt's token ids (all of them, whatever it reads).
        :returns: float32 ``[output_size()]``.
        """
        raise NotImplementedError

    def output_size(self) -> int:
        """Length of the vectors :meth:`pool` returns (``dimensions`` above it are refused); the hidden size."""
        return self.context.hidden_size


class LastPool(PoolingMethod):
    """The last prompt token's hidden state: how decoder embedding models (Qwen3-Embedding,
    e5-mistral, gte-Qwen2) are trained, and vLLM's default for them."""

    name = "last"
    reads = "last"

    def pool(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        """The (only) row it reads."""
        return hidden[-1].clone()


class MeanPool(PoolingMethod):
    """The mean of every prompt token's hidden state (sentence-transformers' ``pooling_mode_mean_tokens``)."""

    name = "mean"
    reads = "all"

    def pool(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        """Mean over the rows."""
        return hidden.mean(dim=0)


class CLSPool(PoolingMethod):
    """The first token's hidden state (BERT's ``[CLS]``; sentence-transformers' ``pooling_mode_cls_token``)."""

    name = "cls"
    reads = "first"

    def pool(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        """The (only) row it reads."""
        return hidden[0].clone()


def rows_read(reads: str, num_tokens: int) -> range:
    """The prompt positions a method reading ``reads`` gets, of a prompt of ``num_tokens`` tokens."""
    if reads == "first":
        return range(0, 1)
    if reads == "last":
        return range(num_tokens - 1, num_tokens)
    return range(num_tokens)


def finish_embedding(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """vLLM's embedding head on one pooled vector (or ``[tokens, d]`` rows): keep the first
    ``dimensions`` entries (Matryoshka), then L2-normalise when ``normalize``; float32."""
    out = vector.float()
    if dimensions is not None:
        out = out[..., :dimensions]
    if normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=-1)
    return out


__all__ = ["CLSPool", "LastPool", "MeanPool", "PoolingContext", "PoolingMethod", "READS", "finish_embedding",
           "rows_read"]
