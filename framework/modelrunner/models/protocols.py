"""What the kernel and adapters expect of each other's models, as structural types."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class TextModel(Protocol):
    """A language model a multimodal adapter can wrap: it starts from input embeddings (into which
    image features are written) and turns final hidden states into logits.

    :class:`~.decoder.DecoderForCausalLM` is one; so is any adapter's model with these methods.
    """

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[tokens, hidden]`` of token ids."""

    def forward(self, batch: Any, kv_caches: list[torch.Tensor], inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        """Final hidden states ``[tokens, hidden]`` of a step, starting from ``inputs_embeds`` when given."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[rows, vocab]`` of final hidden states ``[rows, hidden]``."""
