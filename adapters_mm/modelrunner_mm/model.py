"""The LLaVA model as a composition: a transformers vision tower, the projector, and a language
model built by whichever adapter loads the text config (the native Llama adapter for LLaVA-1.5).

The vision tower and projector have no KV cache, so transformers' own modules run them as they
are; only the language model runs on the paged KV cache. The language model must offer
``embed_input_ids(ids)``, ``forward(batch, kv_caches, inputs_embeds=None)`` and
``compute_logits(hidden)`` (:class:`modelrunner.models.TextModel`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .features import ImageFeatureCache


def image_token_id_of(config: Any) -> int:
    """The placeholder token id of a LLaVA config (``image_token_id``, formerly ``image_token_index``)."""
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ValueError(f"{type(config).__name__} names no image token (image_token_id / image_token_index)")
    return int(token)


class LlavaForConditionalGeneration(nn.Module):
    """Image features projected into the language model's embedding space at the image tokens.

    :param config: the checkpoint's ``LlavaConfig``.
    :param vision_tower: transformers' vision model for ``config.vision_config`` (CLIP, SigLIP, ...).
    :param multi_modal_projector: maps selected vision features to the text hidden size.
    :param language_model: the text model, as its own adapter built it.
    """

    def __init__(self, config: Any, vision_tower: nn.Module, multi_modal_projector: nn.Module,
                 language_model: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = vision_tower
        self.multi_modal_projector = multi_modal_projector
        self.language_model = language_model
        self.image_token_id = image_token_id_of(config)
        """The placeholder token each image's features replace."""
        self.vision_feature_layer: int | list[int] = config.vision_feature_layer
        """Which hidden state(s) of the vision tower feed the projector (several are concatenated)."""
        self.vision_feature_select_strategy: str = config.vision_feature_select_strategy
        """``default`` drops the vision tower's class token; ``full`` keeps every position."""
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.vision_feature_select_strategy!r} is not "
                             "supported (accepted: 'default', 'full')")
        self.image_features = ImageFeatureCache()
        """Per-sequence projected features, so each image is encoded once per request."""

    @property
    def has_class_token(self) -> bool:
        """True when the vision tower prepends a class token to the patches (CLIP; not SigLIP)."""
        return hasattr(getattr(self.vision_tower, "embeddings", None), "class_embedding")

    def tokens_per_image(self, height: int, width: int) -> int:
        """How many placeholder tokens one ``height × width`` preprocessed image fills."""
        patch = int(self.config.vision_config.patch_size)
        tokens = (height // patch) * (width // patch) + int(self.has_class_token)
        return tokens - 1 if self.vision_feature_select_strategy == "default" else tokens

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected features ``[num_images, tokens_per_image, text_hidden]`` of ``[num_images, C, H, W]`` pixels."""
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        layers = self.vision_feature_layer
        chosen = [out.hidden_states[i] for i in (layers if isinstance(layers, (list, tuple)) else [layers])]
        if self.vision_feature_select_strategy == "default":
            chosen = [h[:, 1:] for h in chosen]
        return self.multi_modal_projector(torch.cat(chosen, dim=-1))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The language model's input embeddings ``[tokens, hidden]`` of token ids."""
        return self.language_model.embed_input_ids(input_ids)

    @property
    def parallel(self) -> Any:
        """The language model's tensor/pipeline ranks (the vision parts are replicated)."""
        return self.language_model.parallel

    def forward(self, batch: Any, kv_caches: list[torch.Tensor], inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        """Final hidden states ``[tokens, hidden]``; image features arrive already in ``inputs_embeds``."""
        return self.language_model(batch, kv_caches, inputs_embeds=inputs_embeds, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[rows, vocab_size]`` of final hidden states."""
        return self.language_model.compute_logits(hidden)

    def runner_stats(self) -> dict[str, int]:
        """Shown in ``ModelRunner.stats()["model"]``: images encoded so far, sequences holding features."""
        return self.image_features.stats()
