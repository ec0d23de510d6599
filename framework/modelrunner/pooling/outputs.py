"""What embedding requests give back: vLLM's ``PoolingRequestOutput`` and ``EmbeddingRequestOutput`` shapes."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import attrs
import torch


@attrs.define
class PoolingOutput:
    """A pooling request's result (vLLM's ``PoolingOutput``)."""

    data: torch.Tensor | None
    """float32 ``[d]`` for the ``embed`` task, ``[prompt tokens, d]`` for ``token_embed``; None when the
    request did not finish (aborted, failed)."""


@attrs.define
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]
    """The vector (``[d]``), or one list per token for ``token_embed``."""

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        """The embedding of a :class:`PoolingOutput` (empty when it has no data)."""
        return cls(output.data.tolist() if output.data is not None else [])

    @property
    def hidden_size(self) -> int:
        """Length of the embedding."""
        return len(self.embedding)


O = TypeVar("O")


@attrs.define
class PoolingRequestOutput(Generic[O]):
    """The final state of one pooling request (vLLM's ``PoolingRequestOutput``)."""

    request_id: str
    """The id given to ``add_request``."""
    outputs: O
    """Its :class:`PoolingOutput` (an :class:`EmbeddingOutput` in an :class:`EmbeddingRequestOutput`)."""
    prompt_token_ids: list[int]
    """The prompt's token ids (after ``truncate_prompt_tokens``)."""
    finished: bool
    """Always True: a pooling request reports once, when it ends."""
    finish_reason: str | None = None
    """``"stop"`` when pooled; ``"abort"``, ``"error"`` or ``"length"`` (the KV cache could not hold it) otherwise."""
    error: str | None = None
    """Why the request failed, when it did."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache instead of being computed."""
    metrics: Any = None
    """When it arrived, was first scheduled and finished (:class:`~modelrunner.engine.outputs.RequestMetrics`)."""

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)


@attrs.define
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """A pooling request's output with its embedding as a list (vLLM's ``EmbeddingRequestOutput``):
    ``out.outputs.embedding``."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        """The same output with ``outputs`` an :class:`EmbeddingOutput`."""
        fields = {f.name: getattr(output, f.name) for f in attrs.fields(PoolingRequestOutput)}
        return cls(**{**fields, "outputs": EmbeddingOutput.from_base(output.outputs)})


__all__ = ["EmbeddingOutput", "EmbeddingRequestOutput", "PoolingOutput", "PoolingRequestOutput"]
