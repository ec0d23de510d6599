"""Running one step of a kernel-built causal LM: what an adapter's forward hook usually does."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..distributed import STAGE_INPUTS, STAGE_OUTPUTS
from ..forward_batch import HIDDEN_STATES, RETURN_HIDDEN_STATES, ForwardBatch, ForwardOutput


def run_stage(loaded: Any, batch: ForwardBatch, kv_caches: list[torch.Tensor],
              aux_of: Callable[[Any], dict[str, Any]] | None = None, **model_inputs: Any) -> ForwardOutput:
    """This rank's part of one step of ``loaded.model`` (a :class:`~.decoder.DecoderForCausalLM` or any
    model with a ``parallel`` state, ``forward(batch, kv_caches, **inputs)`` and ``compute_logits``):
    the logits of ``batch.logits_indices`` on the last pipeline stage (with the final hidden states
    of the rows ``batch.extra[RETURN_HIDDEN_STATES]`` asks for in ``aux[HIDDEN_STATES]``), the next
    stage's inputs (in ``aux[STAGE_OUTPUTS]``, with empty logits) on the others.

    :param aux_of: called with the model after its forward; what it returns joins the output's
        ``aux`` (e.g. the MoE adapter's router logits).
    :param model_inputs: passed to the model's forward (e.g. ``inputs_embeds``).
    """
    model = loaded.model
    run = loaded.runnable or model
    parallel = model.parallel
    if not parallel.is_first_stage:
        model_inputs = {**model_inputs, "stage_inputs": batch.extra.get(STAGE_INPUTS)}
    with torch.inference_mode():
        out = run(batch, kv_caches, **model_inputs)
    aux = aux_of(model) if aux_of is not None else {}
    if not parallel.is_last_stage:
        return ForwardOutput(logits=torch.empty(0, loaded.vocab_size), aux={STAGE_OUTPUTS: out, **aux})
    with torch.inference_mode():
        hidden = out.index_select(0, batch.logits_indices)
        pooled_rows = batch.extra.get(RETURN_HIDDEN_STATES)
        if pooled_rows is not None:  # embedding requests: their rows' final hidden states
            aux = {**aux, HIDDEN_STATES: out.index_select(0, pooled_rows.to(out.device))}
    # Logits leave inference mode so callers (samplers, logits processors) may edit them in place.
    with torch.no_grad():
        logits = model.compute_logits(hidden).float()
    return ForwardOutput(logits=logits, aux=aux)
