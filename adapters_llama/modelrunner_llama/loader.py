"""Building a Llama-family model for a checkpoint: on ``meta``, materialised once, weights streamed in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from modelrunner.kv_cache.spec import KVCacheSpec
from modelrunner.layers import select_attention_backend
from modelrunner.parallel_state import ParallelState
from modelrunner.weights import iter_weights, load_weights, materialize

from .model import LlamaForCausalLM, head_dim_of

DEFAULT_MAX_MODEL_LEN = 8192
"""Cap on the default sequence length (the RoPE table size) when the config does not set one."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Any of these in the checkpoint directory means it ships a tokenizer."""


def max_model_len_for(hf_config: Any, max_model_len: int | None) -> int:
    """The configured length, else the model's ``max_position_embeddings`` capped at :data:`DEFAULT_MAX_MODEL_LEN`."""
    if max_model_len:
        return max_model_len
    return min(int(getattr(hf_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)), DEFAULT_MAX_MODEL_LEN)


def build_model(
    hf_config: Any,
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelState | None = None,
    max_model_len: int | None = None,
) -> LlamaForCausalLM:
    """The model for ``hf_config`` with this rank's weights from the safetensors under ``path``.

    :raises modelrunner.weights.CheckpointError: missing weight file, wrong-shaped or missing tensor.
    """
    device = torch.device(device)
    backend = select_attention_backend(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, max_model_len_for(hf_config, max_model_len), parallel, backend)
    materialize(model, device, dtype)
    load_weights(model, iter_weights(path), model.packed_modules_mapping, ignore=model.ignored_weights)
    return model.eval()


def kv_cache_spec_for(model: LlamaForCausalLM, dtype: torch.dtype, block_size: int) -> KVCacheSpec:
    """The paged cache this rank's layers read and write."""
    attn = model.model.layers[0].self_attn
    return KVCacheSpec(
        num_layers=len(model.model.layers),
        num_kv_heads=attn.num_kv_heads,
        head_dim=head_dim_of(model.config),
        dtype=dtype,
        block_size=block_size,
    )


def load_tokenizer(source: Any) -> Any:
    """The checkpoint's tokenizer, or None when its directory has no tokenizer files."""
    if not any((Path(source.path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return source.load_tokenizer()
