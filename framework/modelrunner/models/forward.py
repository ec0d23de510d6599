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
        logits = float32_logits(loaded.extra, model.compute_logits(hidden))
    return ForwardOutput(logits=logits, aux=aux)


_LOGITS_BUFFER = "float32 logits buffer"
"""The key of :func:`float32_logits`' buffer in ``LoadedModel.extra``."""


def float32_logits(state: dict[str, Any], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as float32, written into the rows of the buffer the previous step's logits used when
    nothing holds a view of it any more (else into a new one, which becomes the buffer).

    A batch's float32 logits are large (256 rows of a 49k vocabulary: 50 MB; of a 128k one: 131 MB), and
    glibc serves allocations above 32 MB with fresh pages every time: faulting them in cost 18 ms of a
    batch-256 step's ~200 where converting into pages already mapped costs 2. Each result is a view of
    the buffer, so a caller that keeps a step's logits keeps the buffer busy and the next step gets its own.
    """
    if logits.dtype == torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
        return logits.float()
    rows, width = logits.shape
    found = state.get(_LOGITS_BUFFER)
    if found is not None:
        buffer, idle = found
        if buffer.shape[1] == width and buffer.shape[0] >= rows and _storage_uses(buffer) == idle:
            return buffer[:rows].copy_(logits)
    capacity = found[0].shape[0] if found is not None and found[0].shape[1] == width else 0
    buffer = torch.empty(max(rows, capacity), width)
    state[_LOGITS_BUFFER] = (buffer, _storage_uses(buffer))
    return buffer[:rows].copy_(logits)


def _storage_uses(tensor: torch.Tensor) -> int:
    """How many tensors share ``tensor``'s storage (its views included)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
