"""modelrunner-llama: Llama-family checkpoints run natively on modelrunner's paged KV cache.

Handles ``LlamaForCausalLM`` (Llama 2/3, SmolLM2), ``MistralForCausalLM`` and ``Qwen2ForCausalLM``.

Tensor-parallel plan (applied while building, so each rank only ever loads its shard):
``qkv_proj`` and ``gate_up_proj`` are column-split (by heads / intermediate features),
``o_proj`` and ``down_proj`` row-split with an all-reduce, the embedding and LM head split by
vocabulary rows. Key/value heads are replicated when there are fewer of them than ranks.

Pipeline-parallel plan: stage ``r`` builds only its contiguous range of decoder layers (see
:func:`modelrunner.distributed.stage_layer_range`), the first stage the embedding, the last the
final norm and LM head; the others are :class:`~.model.StageMissingLayer` placeholders that load
nothing. A stage other than the first starts from ``batch.extra[STAGE_INPUTS]``; one other than the
last returns ``{"hidden_states", "residual"}`` in ``aux[STAGE_OUTPUTS]`` (and empty logits).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from modelrunner.distributed import STAGE_INPUTS, STAGE_OUTPUTS
from modelrunner.forward_batch import ForwardOutput
from modelrunner.hookspecs import hookimpl
from modelrunner.loaded_model import LoadedModel

from .loader import build_model, kv_cache_spec_for, load_tokenizer
from .model import LlamaForCausalLM

__all__ = ["ARCHITECTURES", "LlamaForCausalLM", "check_built_for", "forward", "load", "parallelize", "register",
           "run_stage"]

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""The HF ``architectures`` this adapter loads."""

ADAPTER_NAME = "llama"
"""The entry-point name, shown as ``LoadedModel.adapter``."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the architectures this adapter loads."""
    registry.architectures(*ARCHITECTURES)


@hookimpl
def load(source: Any, config: Any, device: torch.device, dtype: torch.dtype, parallel: Any) -> LoadedModel | None:
    """Build the model for ``source`` if it is a Llama-family checkpoint, with this rank's weights."""
    if source.architecture not in ARCHITECTURES:
        return None
    model = build_model(source.hf_config, source.path, device, dtype, parallel, config.model.max_model_len,
                        weights=source.iter_weights(), attention_backend=config.model.attention_backend)
    return LoadedModel(
        model=model,
        tokenizer=load_tokenizer(source),
        hf_config=source.hf_config,
        kv_cache_spec=kv_cache_spec_for(model, dtype, config.cache.block_size),
        adapter=ADAPTER_NAME,
        runnable=model,
    )


@hookimpl
def forward(loaded: LoadedModel, batch: Any, kv_caches: list[torch.Tensor]) -> torch.Tensor | ForwardOutput | None:
    """Float32 logits for the rows ``batch.logits_indices`` of the step's flattened tokens (on a
    pipeline stage other than the last: empty logits and the next stage's inputs in ``aux``)."""
    if not isinstance(loaded.model, LlamaForCausalLM):
        return None
    return run_stage(loaded, batch, kv_caches)


def run_stage(loaded: LoadedModel, batch: Any, kv_caches: list[torch.Tensor],
              aux_of: Callable[[Any], dict[str, Any]] | None = None) -> torch.Tensor | ForwardOutput:
    """This rank's part of one step for a :class:`LlamaForCausalLM` (or a subclass): the logits on the
    last pipeline stage, the next stage's inputs (in ``aux[STAGE_OUTPUTS]``) on the others.

    :param aux_of: called with the model after its forward; what it returns joins the output's ``aux``
        (e.g. the MoE adapter's router logits).
    """
    model = loaded.model
    run = loaded.runnable or model
    stage = {} if model.parallel.is_first_stage else {"stage_inputs": batch.extra.get(STAGE_INPUTS)}
    with torch.inference_mode():
        out = run(batch.input_ids, batch.positions, batch, kv_caches, **stage)
    aux = aux_of(model) if aux_of is not None else {}
    if not model.parallel.is_last_stage:
        return ForwardOutput(logits=torch.empty(0, loaded.vocab_size), aux={STAGE_OUTPUTS: out, **aux})
    with torch.inference_mode():
        hidden = out.index_select(0, batch.logits_indices)
    # Logits leave inference mode so callers (samplers, tests) may still edit them in place.
    with torch.no_grad():
        logits = model.compute_logits(hidden).float()
    return ForwardOutput(logits=logits, aux=aux) if aux else logits


@hookimpl
def parallelize(loaded: LoadedModel, parallel: Any) -> LoadedModel | None:
    """Check the model was built for this rank's shard (the split happens at load); nothing else to do."""
    if not isinstance(loaded.model, LlamaForCausalLM):
        return None
    check_built_for(loaded.model, parallel)
    return loaded


def check_built_for(model: LlamaForCausalLM, parallel: Any) -> None:
    """Raise ``ValueError`` unless ``model`` was built for ``parallel``'s tensor rank and pipeline stage."""
    built = model.parallel
    if (built.tp_rank, built.tp_size) != (parallel.tp_rank, parallel.tp_size):
        raise ValueError(
            f"model was loaded for tensor-parallel rank {built.tp_rank}/{built.tp_size}, "
            f"but parallelize was called for {parallel.tp_rank}/{parallel.tp_size}; pass the same ParallelState to load"
        )
    if (built.pp_rank, built.pp_size) != (parallel.pp_rank, parallel.pp_size):
        raise ValueError(
            f"model was loaded for pipeline stage {built.pp_rank}/{built.pp_size}, "
            f"but parallelize was called for {parallel.pp_rank}/{parallel.pp_size}; pass the same ParallelState to load"
        )
