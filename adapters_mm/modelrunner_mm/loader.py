"""Loading a LLaVA checkpoint: its language model through the kernel's load hook, its vision tower
and projector as transformers modules with the checkpoint's weights.

Checkpoints name LLaVA's parts two ways, and both load: the layout transformers writes
(``language_model.model.*``, ``language_model.lm_head.*``, ``vision_tower.*``,
``multi_modal_projector.*``; older ones add ``vision_tower.vision_model.``) and the layout of
transformers' modules (``model.language_model.*``, ``lm_head.*``, ``model.vision_tower.*``,
``model.multi_modal_projector.*``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from modelrunner.api import LoadedModel, ModelRunnerError, TextModel, iter_weights, load_weights

TEXT_WEIGHT_RENAMES = (("language_model.", ""), ("model.language_model.", "model."), ("lm_head.", "lm_head."))
"""Checkpoint prefixes of the language model → the names a causal-LM adapter expects."""

IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
"""Either file in the checkpoint means it ships an image processor."""


def text_source(source: Any) -> Any:
    """The language model's part of a LLaVA checkpoint, as a source any text adapter can load: its
    ``hf_config`` is ``text_config`` (with the matching causal-LM architecture), its weights the
    language model's, renamed by :data:`TEXT_WEIGHT_RENAMES`.

    :raises ValueError: transformers knows no causal LM for the text config's ``model_type``.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = copy.deepcopy(source.hf_config.text_config)
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text.model_type)
    if architecture is None:
        raise ValueError(f"{source.path}: text_config has model_type {text.model_type!r}, which has no causal-LM "
                         "architecture in transformers, so no adapter can load the language model")
    text.architectures = [architecture]
    return attrs.evolve(source, hf_config=text, weight_renames=TEXT_WEIGHT_RENAMES)


def load_language_model(source: Any, loader: Any) -> LoadedModel:
    """The language model of a LLaVA checkpoint, loaded by whichever plugin registered its architecture.

    :raises UnknownNameError: no installed adapter loads the text architecture.
    :raises ModelRunnerError: the adapter that did cannot start from input embeddings.
    """
    part = text_source(source)
    loaded = loader.load(part)
    if loaded.kv_cache_spec is None or not isinstance(loaded.model, TextModel):
        raise ModelRunnerError(
            f"{source.path}: the language model ({part.architecture}) was loaded by adapter {loaded.adapter!r}, "
            "which cannot run it inside LLaVA: it needs a paged KV cache and a model with embed_input_ids(ids), "
            "forward(batch, kv_caches, inputs_embeds=) and compute_logits(hidden) (modelrunner.models.TextModel); "
            "install a native adapter for it (e.g. modelrunner-llama)"
        )
    return loaded


def build_vision(hf_config: Any, path: str | Path, device: torch.device,
                 dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """The vision tower and multi-modal projector with the checkpoint's weights, in eval mode.

    :raises modelrunner.loading.weights.CheckpointError: a tensor is missing or has the wrong shape.
    """
    from transformers import AutoModel
    from transformers.initialization import no_init_weights
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    with no_init_weights(), torch.device(device):
        tower = AutoModel.from_config(hf_config.vision_config, dtype=dtype)
        projector = LlavaMultiModalProjector(hf_config).to(dtype)
    parts = nn.ModuleDict({"vision_tower": tower, "multi_modal_projector": projector})
    wrapped = any(name.startswith("vision_model.") for name, _ in tower.named_parameters())
    renames = []
    for outer in ("", "model."):
        if not wrapped:  # older checkpoints nest the tower one level deeper than today's modules
            renames.append((f"{outer}vision_tower.vision_model.", "vision_tower."))
        renames += [(f"{outer}vision_tower.", "vision_tower."),
                    (f"{outer}multi_modal_projector.", "multi_modal_projector.")]
    load_weights(parts, iter_weights(path, renames), name=str(path))
    return tower.eval(), projector.eval()


def load_image_processor(path: str | Path) -> Any:
    """The checkpoint's image processor (the PIL one: no torchvision needed), or None if it ships none."""
    if not any((Path(path) / name).is_file() for name in IMAGE_PROCESSOR_FILES):
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(path), backend="pil")
