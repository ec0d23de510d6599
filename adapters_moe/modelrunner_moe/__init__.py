"""modelrunner-moe: mixture-of-experts checkpoints run natively on modelrunner's paged KV cache.

Handles ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` and ``Qwen3MoeForCausalLM`` (routing rules
in :mod:`.spec`), reusing the Llama adapter's decoder and the kernel's
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

Pipeline parallelism works as in the Llama adapter (whose model this one extends): each stage builds
and loads only its layers, and passes ``{"hidden_states", "residual"}`` on. Router logits are then
per stage: each stage's forward returns those of its own sparse layers.

The hooks are ``tryfirst``: :class:`MoeForCausalLM` subclasses the Llama model, so the Llama
adapter's ``isinstance`` checks would otherwise claim it too.
"""

from __future__ import annotations

from typing import Any

import torch

from modelrunner.forward_batch import ForwardOutput
from modelrunner.hookspecs import hookimpl
from modelrunner.loaded_model import LoadedModel
from modelrunner_llama import check_built_for, run_stage
from modelrunner_llama.loader import kv_cache_spec_for, load_tokenizer

from .loader import build_moe_model
from .model import MoeForCausalLM
from .spec import ARCHITECTURES as _BY_MODEL_TYPE
from .spec import MoeSpec

__all__ = ["ARCHITECTURES", "MoeForCausalLM", "MoeSpec", "build_moe_model", "forward", "load", "parallelize",
           "register"]

ARCHITECTURES = tuple(_BY_MODEL_TYPE.values())
"""The HF ``architectures`` this adapter loads."""

ADAPTER_NAME = "moe"
"""The entry-point name, shown as ``LoadedModel.adapter``."""

RETURN_ROUTER_LOGITS = "return_router_logits"
"""The ``ForwardBatch.extra`` key that asks for router logits."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the architectures this adapter loads."""
    registry.architectures(*ARCHITECTURES)


@hookimpl
def load(source: Any, config: Any, device: torch.device, dtype: torch.dtype, parallel: Any) -> LoadedModel | None:
    """Build the model for ``source`` if it is a Mixtral / Qwen-MoE checkpoint, with this rank's weights."""
    if source.architecture not in ARCHITECTURES:
        return None
    model = build_moe_model(source.hf_config, source.path, device, dtype, parallel, config.model.max_model_len,
                            attention_backend=config.model.attention_backend)
    return LoadedModel(
        model=model,
        tokenizer=load_tokenizer(source),
        hf_config=source.hf_config,
        kv_cache_spec=kv_cache_spec_for(model, dtype, config.cache.block_size),
        adapter=ADAPTER_NAME,
        runnable=model,
    )


@hookimpl(tryfirst=True)
def forward(loaded: LoadedModel, batch: Any, kv_caches: list[torch.Tensor]) -> ForwardOutput | None:
    """Float32 logits for the rows ``batch.logits_indices``, and this stage's router logits when asked
    (on a pipeline stage other than the last: empty logits and the next stage's inputs in ``aux``)."""
    model = loaded.model
    if not isinstance(model, MoeForCausalLM):
        return None
    asked = batch.extra.get(RETURN_ROUTER_LOGITS)
    wanted = model.return_router_logits if asked is None else bool(asked)
    out = run_stage(loaded, batch, kv_caches, (lambda m: {"router_logits": m.router_logits()}) if wanted else None)
    return out if isinstance(out, ForwardOutput) else ForwardOutput(logits=out)


@hookimpl(tryfirst=True)
def parallelize(loaded: LoadedModel, parallel: Any) -> LoadedModel | None:
    """Check the model was built for this rank's shard (the split happens at load); nothing else to do."""
    if not isinstance(loaded.model, MoeForCausalLM):
        return None
    check_built_for(loaded.model, parallel)
    return loaded
