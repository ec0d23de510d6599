"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) as the kernel's shared decoder.

:class:`~modelrunner.models.DecoderForCausalLM` already is the Llama architecture; the family's
differences are config switches it reads:

- Qwen2: biases on ``q/k/v`` (not ``o``); Llama's ``attention_bias`` puts them on all four
  (:meth:`LlamaForCausalLM.attention_biases`).
- Mistral: ``sliding_window`` on every layer; Qwen2: on the layers ``layer_types`` marks
  ``sliding_attention``. A window at least ``max_position`` long is dropped (it can never hide a key).
- ``tie_word_embeddings``: the LM head shares the embedding's parameter.
"""

from __future__ import annotations

from typing import Any

from modelrunner.api import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """A Llama-family causal LM over a flattened, paged batch (see :class:`DecoderForCausalLM`)."""

    def attention_biases(self, config: Any) -> tuple[bool, bool]:
        """Qwen2: q/k/v biases only; the others: ``attention_bias`` on all four projections."""
        if config.model_type == "qwen2":
            return True, False
        return super().attention_biases(config)
