"""modelrunner-example-gpt2: the README's example adapter, running GPT-2 checkpoints on the paged KV cache."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from modelrunner import hookimpl
from modelrunner.kv_cache.spec import KVCacheSpec
from modelrunner.layers import select_attention_backend
from modelrunner.loaded_model import LoadedModel
from modelrunner.weights import load_weights, materialize

from .model import GPT2LMHeadModel

ARCHITECTURE = "GPT2LMHeadModel"

# Checkpoints saved from GPT2Model (e.g. openai-community/gpt2) lack the "transformer." prefix.
RENAMES = (("transformer.", "transformer."), ("lm_head.", "lm_head."), ("", "transformer."))
# Causal-mask buffers of old checkpoints, and the LM head that is tied to the embedding.
IGNORED = (".attn.bias", ".attn.masked_bias", "lm_head.weight")


@hookimpl
def register(registry: Any) -> None:
    """Declare the architecture the load hook accepts (``modelrunner plugins`` lists it)."""
    registry.architectures(ARCHITECTURE)


@hookimpl
def load(source: Any, config: Any, device: torch.device, dtype: torch.dtype) -> LoadedModel | None:
    """Build GPT-2 on ``meta``, give it storage once, stream the checkpoint in; None for other models."""
    if source.architecture != ARCHITECTURE:
        return None
    hf = source.hf_config
    with torch.device("meta"):  # no memory, no random init: the checkpoint fills every parameter
        model = GPT2LMHeadModel(hf, select_attention_backend(device, config.model.attention_backend))
    materialize(model, device, dtype)
    load_weights(model, attrs.evolve(source, weight_renames=RENAMES).iter_weights(), ignore=IGNORED)
    spec = KVCacheSpec(num_layers=hf.n_layer, num_kv_heads=hf.n_head, head_dim=hf.n_embd // hf.n_head,
                       dtype=dtype, block_size=config.cache.block_size)
    return LoadedModel(model=model.eval(), tokenizer=source.load_tokenizer(), hf_config=hf,
                       kv_cache_spec=spec, adapter="example_gpt2", runnable=model)


@hookimpl
def parallelize(loaded: LoadedModel, parallel: Any) -> LoadedModel | None:
    """Nothing to split in one process; this example has no tensor/pipeline-parallel plan."""
    if not isinstance(loaded.model, GPT2LMHeadModel):
        return None
    if parallel.world_size > 1:
        raise ValueError(f"example_gpt2 runs in one process only, got tensor_parallel_size={parallel.tp_size} "
                         f"and pipeline_parallel_size={parallel.pp_size}; set both to 1")
    return loaded


@hookimpl
def forward(loaded: LoadedModel, batch: Any, kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
    """Float32 logits ``[len(batch.logits_indices), vocab]`` of one step; None for other models."""
    if not isinstance(loaded.model, GPT2LMHeadModel):
        return None
    with torch.no_grad():
        hidden = loaded.runnable(batch.input_ids, batch.positions, batch, kv_caches)
        return loaded.model.lm_head(hidden.index_select(0, batch.logits_indices)).float()
