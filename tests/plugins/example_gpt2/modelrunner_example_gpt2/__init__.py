"""modelrunner-example-gpt2: the README's example adapter, running GPT-2 checkpoints on the paged KV cache."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from modelrunner import hookimpl
from modelrunner.loaded_model import LoadedModel
from modelrunner.api import build_and_load, loaded_for

from .model import GPT2LMHeadModel

ARCHITECTURE = "GPT2LMHeadModel"

# Checkpoints saved from GPT2Model (e.g. openai-community/gpt2) lack the "transformer." prefix.
RENAMES = (("transformer.", "transformer."), ("lm_head.", "lm_head."), ("", "transformer."))
# Causal-mask buffers of old checkpoints, and the LM head that is tied to the embedding.
IGNORED = (".attn.bias", ".attn.masked_bias", "lm_head.weight")


@hookimpl
def register(registry: Any) -> None:
    """Declare the architecture; the kernel calls this plugin's other hooks only for it."""
    registry.architectures(ARCHITECTURE)


@hookimpl
def load(source: Any, config: Any, device: torch.device, dtype: torch.dtype, attention_backend: Any) -> LoadedModel:
    """Build GPT-2 on ``meta``, give it storage once, stream the checkpoint in."""
    renamed = attrs.evolve(source, weight_renames=RENAMES)
    model = build_and_load(lambda: GPT2LMHeadModel(source.hf_config, attention_backend), renamed, device, dtype,
                           ignore=IGNORED)
    return loaded_for(model, source, config, dtype)


@hookimpl
def parallelize(parallel: Any) -> None:
    """Nothing to split in one process; this example has no tensor/pipeline-parallel plan."""
    if parallel.world_size > 1:
        raise ValueError(f"example_gpt2 runs in one process only, got tensor_parallel_size={parallel.tp_size} "
                         f"and pipeline_parallel_size={parallel.pp_size}; set both to 1")


@hookimpl
def forward(loaded: LoadedModel, batch: Any, kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """Float32 logits ``[len(batch.logits_indices), vocab]`` of one step."""
    with torch.no_grad():
        hidden = loaded.runnable(batch, kv_caches)
        return loaded.model.lm_head(hidden.index_select(0, batch.logits_indices)).float()
