"""Building a model for a checkpoint: on ``meta``, materialised once, this rank's weights streamed in."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..kv_cache.spec import KVCacheSpec
from ..layers.attention import Attention
from ..loaded_model import LoadedModel
from ..weights import load_weights, materialize
from .stages import StageWeights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Any of these in the checkpoint directory means it ships a tokenizer."""

Weights = Iterable[tuple[str, torch.Tensor]]
"""``(name, tensor)`` pairs of a checkpoint."""


def build_and_load(factory: Callable[[], nn.Module], source: Any, device: torch.device | str, dtype: torch.dtype,
                   weights: Weights | None = None, transform: Callable[[Weights], Weights] | None = None,
                   packed_modules_mapping: dict[str, list[str]] | None = None,
                   ignore: tuple[str, ...] | None = None) -> nn.Module:
    """The model ``factory()`` builds, with its weights from ``source``, in eval mode.

    The factory runs under ``torch.device("meta")`` (no memory, no random init); the model is then
    materialised once on ``device`` in ``dtype``, and the checkpoint streamed into each parameter's
    ``weight_loader``. Under pipeline parallelism (a model whose ``parallel.pp_size`` > 1) other
    stages' tensors are skipped.

    :param source: the :class:`~modelrunner.source.ModelSource`; its ``iter_weights()`` (which honours
        ``weight_renames``) is read unless ``weights`` is given.
    :param transform: renames or regroups the tensors before loading (e.g. an MoE expert layout).
    :param packed_modules_mapping: default ``model.packed_modules_mapping``.
    :param ignore: checkpoint name suffixes to skip; default ``model.ignored_weights``.
    :raises modelrunner.weights.CheckpointError: missing weight file, wrong-shaped or missing tensor.
    """
    with torch.device("meta"):
        model = factory()
    materialize(model, device, dtype)
    weights = source.iter_weights() if weights is None else weights
    parallel = getattr(model, "parallel", None)
    if parallel is not None and parallel.pp_size > 1:
        weights = StageWeights(weights, model)
    if transform is not None:
        weights = transform(weights)
    load_weights(model, weights, packed_modules_mapping if packed_modules_mapping is not None
                 else getattr(model, "packed_modules_mapping", None),
                 ignore=ignore if ignore is not None else tuple(getattr(model, "ignored_weights", ())))
    return model.eval()


def kv_cache_spec_for(model: nn.Module, dtype: torch.dtype, block_size: int) -> KVCacheSpec:
    """The paged cache of ``model``'s :class:`~modelrunner.layers.Attention` layers on this rank (those
    of its pipeline stage), one cache tensor per layer in module order.

    :raises ValueError: the model has no attention layer, or its layers differ in kv heads or head size.
    """
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no modelrunner.layers.Attention layer to size a KV cache for")
    shapes = {(m.num_kv_heads, m.head_dim) for m in layers}
    if len(shapes) > 1:
        raise ValueError(f"{type(model).__name__}'s attention layers differ in (kv heads, head dim): "
                         f"{sorted(shapes)}; one KV-cache spec needs them equal")
    kv_heads, head_dim = shapes.pop()
    return KVCacheSpec(num_layers=len(layers), num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                       block_size=block_size)


def load_tokenizer(source: Any) -> Any:
    """The checkpoint's tokenizer, or None when its directory has no tokenizer files."""
    if not any((Path(source.path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    return source.load_tokenizer()


def loaded_for(model: nn.Module, source: Any, config: Any, dtype: torch.dtype) -> LoadedModel:
    """What a load hook returns for a kernel-built model: the model, the checkpoint's tokenizer (None
    without tokenizer files), its config, and the KV-cache spec of its attention layers."""
    return LoadedModel(model=model, tokenizer=load_tokenizer(source), hf_config=source.hf_config,
                       kv_cache_spec=kv_cache_spec_for(model, dtype, config.cache.block_size))
