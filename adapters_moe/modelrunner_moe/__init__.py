"""modelrunner-moe: mixture-of-experts checkpoints run natively on modelrunner's paged KV cache.

Handles ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM`` (routing rules
in :mod:`.spec`), on the kernel's shared decoder (:mod:`modelrunner.models`) and its
:class:`~modelrunner.layers.fused_moe.FusedMoE` experts.

Router logits: the forward hook returns a :class:`~modelrunner.forward_batch.ForwardOutput` whose
``aux["router_logits"]`` lists one ``[num_tokens, num_experts]`` tensor per sparse layer when the
batch asks (``batch.extra["return_router_logits"]``) or the config's ``output_router_logits`` is
set. Per-expert token counts are in ``ModelRunner.stats()["model"]``.

Tensor-parallel plan (applied while building, so each rank only ever loads its shard): attention,
dense MLPs and Qwen2-MoE's shared expert split like the Llama adapter's (column/row with an
all-reduce); routed experts are *expert parallel* — rank ``r`` holds experts
``[r·E/tp, (r+1)·E/tp)`` whole, the router is replicated, and the ranks' partial outputs are
all-reduced. Whole experts keep each expert's matmuls unsplit (better on small decode batches than
splitting every expert's ``intermediate`` across ranks) and need ``num_experts % tp_size == 0``.

Pipeline parallelism works as for every model built on the shared decoder: each stage builds and
loads only its layers, and passes ``{"hidden_states", "residual"}`` on. Router logits are then per
stage: each stage's forward returns those of its own sparse layers.
"""

from __future__ import annotations

from typing import Any

import torch

from modelrunner.api import ForwardOutput, LoadedModel, check_built_for, hookimpl, loaded_for, run_stage

from .loader import build_moe_model
from .model import MoeForCausalLM
from .spec import ARCHITECTURES as _BY_MODEL_TYPE
from .spec import MoeSpec

__all__ = ["ARCHITECTURES", "MoeForCausalLM", "MoeSpec", "build_moe_model", "forward", "load", "parallelize",
           "register"]

ARCHITECTURES = tuple(_BY_MODEL_TYPE.values())
"""The HF ``architectures`` this adapter loads."""

RETURN_ROUTER_LOGITS = "return_router_logits"
"""The ``ForwardBatch.extra`` key that asks for router logits."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the architectures this adapter loads."""
    registry.architectures(*ARCHITECTURES, tensor_parallel=True, pipeline_parallel=True, quantization=("*",),
                           devices=("cpu", "cuda"), attention_backends=True)


@hookimpl
def load(source: Any, loader: Any) -> LoadedModel:
    """Build the Mixtral / Qwen-MoE model for ``source`` with this rank's weights (the loader carries
    the device, dtype, ranks, attention backend and sequence length)."""
    return loaded_for(build_moe_model(source, loader), source, loader.config, loader.dtype)


@hookimpl
def forward(loaded: LoadedModel, batch: Any, kv_caches: list[torch.Tensor]) -> ForwardOutput:
    """Float32 logits for the rows ``batch.logits_indices``, and this stage's router logits when asked
    (on a pipeline stage other than the last: empty logits and the next stage's inputs in ``aux``)."""
    model = loaded.model
    asked = batch.extra.get(RETURN_ROUTER_LOGITS)
    wanted = model.return_router_logits if asked is None else bool(asked)
    return run_stage(loaded, batch, kv_caches, (lambda m: {"router_logits": m.router_logits()}) if wanted else None)


@hookimpl
def parallelize(loaded: LoadedModel, parallel: Any) -> None:
    """Check the model was built for this rank's shard (the split happens at load); nothing else to do."""
    check_built_for(loaded.model, parallel)
