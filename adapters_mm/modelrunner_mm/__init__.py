"""modelrunner-mm: LLaVA-style vision-language models with images in prompts.

Handles ``LlavaForConditionalGeneration``. The language model is loaded through the kernel's own
load hook from ``text_config`` (so the native Llama adapter runs LLaVA-1.5's Vicuna/Llama, on the
paged KV cache), the vision tower and projector are transformers' modules (they keep no KV cache).

A request ``{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "images": [PIL.Image]}`` is
turned by ``process_inputs`` into pixel values and a prompt whose placeholder is repeated once per
image feature; the forward hook writes the features into the input embeddings at those positions.
"""

from __future__ import annotations

from typing import Any

import torch

from modelrunner.api import LoadedModel, hookimpl, run_stage

from .inputs import ImageInputProcessor
from .loader import build_vision, load_image_processor, load_language_model
from .model import LlavaForConditionalGeneration

__all__ = ["ARCHITECTURES", "LlavaForConditionalGeneration", "forward", "load", "parallelize", "process_inputs",
           "register"]

ARCHITECTURES = ("LlavaForConditionalGeneration",)
"""The HF ``architectures`` this adapter loads."""

LANGUAGE_MODEL = "language_model"
"""``LoadedModel.parts`` key: the language model's own :class:`LoadedModel`."""
INPUT_PROCESSOR = "input_processor"
"""``LoadedModel.extra`` key: the request's :class:`~modelrunner_mm.inputs.ImageInputProcessor`."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the architectures this adapter loads."""
    registry.architectures(*ARCHITECTURES, tensor_parallel=True, pipeline_parallel=False, quantization=("none",),
                           devices=("cpu", "cuda"), attention_backends=True)


@hookimpl
def load(source: Any, device: torch.device, dtype: torch.dtype, parallel: Any, loader: Any) -> LoadedModel:
    """Build the LLaVA model for ``source``: its language model through the kernel's loader, then the vision parts."""
    if parallel.pp_size != 1:
        raise ValueError(f"the mm adapter does not implement pipeline parallelism (pp_size={parallel.pp_size}); "
                         "use tensor parallelism or pipeline_parallel_size=1")
    text = load_language_model(source, loader)
    tower, projector = build_vision(source.hf_config, source.path, device, dtype)
    model = LlavaForConditionalGeneration(source.hf_config, tower, projector, text.model)
    tokenizer = text.tokenizer
    image_token = tokenizer.convert_ids_to_tokens(model.image_token_id) if tokenizer is not None else "<image>"
    inputs = ImageInputProcessor(load_image_processor(source.path), model.image_token_id, str(image_token),
                                 model.tokens_per_image, str(source.path))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        hf_config=source.hf_config,
        kv_cache_spec=text.kv_cache_spec,
        runnable=model,
        extra={INPUT_PROCESSOR: inputs},
        parts={LANGUAGE_MODEL: text},
    )


@hookimpl
def process_inputs(loaded: LoadedModel, token_ids: list[int],
                   extra: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """Preprocess the request's images and expand its image placeholders (see :class:`ImageInputProcessor`)."""
    return loaded.extra[INPUT_PROCESSOR](token_ids, extra)


@hookimpl
def forward(loaded: LoadedModel, batch: Any, kv_caches: list[torch.Tensor]) -> Any:
    """Float32 logits for ``batch.logits_indices``; image features replace the image tokens' embeddings."""
    model = loaded.model
    with torch.inference_mode():
        embeds = model.image_features.input_embeddings(model, batch)
    return run_stage(loaded, batch, kv_caches, inputs_embeds=embeds)


@hookimpl
def parallelize(loaded: LoadedModel) -> None:
    """The kernel already applied the language model's own plan (it is a part); the vision parts stay
    replicated, so only the wrapper's reference to the language model is refreshed."""
    loaded.model.language_model = loaded.parts[LANGUAGE_MODEL].model
