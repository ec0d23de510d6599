"""Building a Llama-family model for a checkpoint: on ``meta``, materialised once, weights streamed in."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from modelrunner.kv_cache.spec import KVCacheSpec
from modelrunner.layers import select_attention_backend
from modelrunner.parallel_state import ParallelState
from modelrunner.weights import iter_weights, load_weights, materialize

from .model import LlamaForCausalLM, StageMissingLayer, head_dim_of

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
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    attention_backend: str | None = None,
) -> LlamaForCausalLM:
    """The model for ``hf_config`` with this rank's weights from the safetensors under ``path``.

    :param weights: the ``(name, tensor)`` pairs to load instead of every tensor under ``path``
        (e.g. ``source.iter_weights()`` for the language model of a composite checkpoint).
    :param attention_backend: the paged-attention backend's name; None: the best one for ``device``.
    :raises modelrunner.weights.CheckpointError: missing weight file, wrong-shaped or missing tensor.
    """
    device = torch.device(device)
    backend = select_attention_backend(device, attention_backend)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, max_model_len_for(hf_config, max_model_len), parallel, backend)
    materialize(model, device, dtype)
    weights = iter_weights(path) if weights is None else weights
    if model.parallel.pp_size > 1:
        weights = StageWeights(weights, model)
    load_weights(model, weights, model.packed_modules_mapping, ignore=model.ignored_weights)
    return model.eval()


class StageWeights:
    """The checkpoint tensors of the modules on ``model``'s pipeline stage; other stages' are skipped.

    :param weights: ``(name, tensor)`` pairs, e.g. :func:`modelrunner.weights.iter_weights`.
    :param model: a model built for one pipeline stage (other stages' modules are :class:`StageMissingLayer`).
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], model: torch.nn.Module) -> None:
        self.weights = weights
        """The whole checkpoint."""
        self.path = getattr(weights, "path", "checkpoint")
        """The checkpoint directory (named in errors)."""
        self.skipped_prefixes = tuple(f"{name}." for name, module in model.named_modules()
                                      if isinstance(module, StageMissingLayer))
        """Name prefixes of the modules that live on other stages."""

    def __iter__(self) -> Any:
        return ((name, t) for name, t in self.weights if not name.startswith(self.skipped_prefixes))

    def file_of(self, name: str) -> Path | None:
        """The file a tensor came from, when the underlying checkpoint knows."""
        file_of = getattr(self.weights, "file_of", None)
        return file_of(name) if file_of else None


def kv_cache_spec_for(model: LlamaForCausalLM, dtype: torch.dtype, block_size: int) -> KVCacheSpec:
    """The paged cache this rank's layers (those of its pipeline stage) read and write."""
    attn = model.model.layers[model.model.start_layer].self_attn
    return KVCacheSpec(
        num_layers=model.model.end_layer - model.model.start_layer,
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
