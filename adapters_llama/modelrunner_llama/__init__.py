"""modelrunner-llama: Llama-family checkpoints run natively on modelrunner's paged KV cache.

Handles ``LlamaForCausalLM`` (Llama 2/3, SmolLM2), ``MistralForCausalLM`` and ``Qwen2ForCausalLM``.

Tensor-parallel plan (applied while building, so each rank only ever loads its shard):
``qkv_proj`` and ``gate_up_proj`` are column-split (by heads / intermediate features),
``o_proj`` and ``down_proj`` row-split with an all-reduce, the embedding and LM head split by
vocabulary rows. Key/value heads are replicated when there are fewer of them than ranks.

Pipeline-parallel plan: stage ``r`` builds only its contiguous range of decoder layers (see
:func:`modelrunner.distributed.stage_layer_range`), the first stage the embedding, the last the
final norm and LM head; the others are :class:`~modelrunner.models.StageMissingLayer` placeholders
that load nothing. A stage other than the first starts from ``batch.extra[STAGE_INPUTS]``; one other
than the last returns ``{"hidden_states", "residual"}`` in ``aux[STAGE_OUTPUTS]`` (and empty logits).
"""

from __future__ import annotations

from typing import Any

import torch

from modelrunner.api import ForwardOutput, LoadedModel, build_and_load, check_built_for, hookimpl, loaded_for, run_stage

from .model import LlamaForCausalLM

__all__ = ["ARCHITECTURES", "LlamaForCausalLM", "forward", "load", "parallelize", "register"]

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""The HF ``architectures`` this adapter loads."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the architectures this adapter loads."""
    registry.architectures(*ARCHITECTURES, tensor_parallel=True, pipeline_parallel=True, quantization=("*",),
                           devices=("cpu", "cuda"), attention_backends=True)


@hookimpl
def load(source: Any, config: Any, device: torch.device, dtype: torch.dtype, parallel: Any,
         attention_backend: Any, max_model_len: int) -> LoadedModel:
    """Build the Llama-family model for ``source`` with this rank's weights."""
    model = build_and_load(lambda: LlamaForCausalLM(source.hf_config, max_model_len, parallel, attention_backend),
                           source, device, dtype)
    return loaded_for(model, source, config, dtype)


@hookimpl
def forward(loaded: LoadedModel, batch: Any, kv_caches: list[torch.Tensor]) -> ForwardOutput:
    """Float32 logits for the rows ``batch.logits_indices`` of the step's flattened tokens (on a
    pipeline stage other than the last: empty logits and the next stage's inputs in ``aux``)."""
    return run_stage(loaded, batch, kv_caches)


@hookimpl
def parallelize(loaded: LoadedModel, parallel: Any) -> None:
    """Check the model was built for this rank's shard (the split happens at load); nothing else to do."""
    check_built_for(loaded.model, parallel)
