"""Building a model for a checkpoint: on ``meta``, materialised once, this rank's weights streamed in."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..kv_cache.spec import KVCacheSpec
from ..layers.attention import Attention
from ..loaded_model import LoadedModel
from .weights import load_weights, materialize
from ..models.stages import StageWeights

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
    stages' tensors are skipped. When ``source.quantization`` is set, that method gives the layers it
    covers quantized storage before anything is allocated, and finishes them after loading — so an
    adapter built on this function gets quantization without code of its own.

    :param source: the :class:`~modelrunner.loading.source.ModelSource`; its ``iter_weights()`` (which honours
        ``weight_renames``) is read unless ``weights`` is given.
    :param transform: renames or regroups the tensors before loading (e.g. an MoE expert layout).
    :param packed_modules_mapping: default ``model.packed_modules_mapping``.
    :param ignore: checkpoint name suffixes to skip; default ``model.ignored_weights``.
    :raises modelrunner.loading.weights.CheckpointError: missing weight file, wrong-shaped or missing tensor.
    """
    with torch.device("meta"):
        model = factory()
    method = getattr(source, "quantization", None)
    if method is not None:
        method.device = torch.device(device)
        method.prepare(model, source)  # on meta: quantized storage replaces the float weights it covers
    materialize(model, device, dtype)
    own_weights = weights is None
    weights = source.iter_weights() if own_weights else weights
    parallel = getattr(model, "parallel", None)
    if parallel is not None and parallel.pp_size > 1:
        weights = StageWeights(weights, model)
    if transform is not None:
        weights = transform(weights)
    load_weights(model, weights, packed_modules_mapping if packed_modules_mapping is not None
                 else getattr(model, "packed_modules_mapping", None),
                 ignore=ignore if ignore is not None else tuple(getattr(model, "ignored_weights", ())))
    if own_weights and callable(getattr(source, "release_weights", None)):
        source.release_weights()
    if method is not None:
        method.process_after_loading(model)
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
    """The checkpoint's tokenizer, or None when it has none (:meth:`ModelSource.load_tokenizer`)."""
    return source.load_tokenizer()


def loaded_for(model: nn.Module, source: Any, config: Any, dtype: torch.dtype) -> LoadedModel:
    """What a load hook returns for a kernel-built model: the model, the checkpoint's tokenizer (None
    without tokenizer files), its config, and the KV-cache spec of its attention layers."""
    return LoadedModel(model=model, tokenizer=load_tokenizer(source), hf_config=source.hf_config,
                       kv_cache_spec=kv_cache_spec_for(model, dtype, config.cache.block_size))
