"""A request's images → pixel values through the checkpoint's image processor, and each image
placeholder in the prompt expanded to the number of tokens that image's features fill."""

from __future__ import annotations

from typing import Any

import torch

from .features import IMAGE_POSITIONS, PIXEL_VALUES

IMAGES = "images"
"""The request key callers put their images under (``{"prompt": ..., "images": [PIL.Image, ...]}``)."""


class ImageInputProcessor:
    """Validates a request's images, preprocesses them and expands the prompt's placeholders.

    :param image_processor: the checkpoint's transformers image processor (None when the
        checkpoint ships none: then only text-only requests are accepted).
    :param image_token_id: the placeholder token.
    :param image_token: the placeholder as text (for messages).
    :param tokens_per_image: ``(height, width)`` of a preprocessed image → placeholder tokens it fills.
    :param checkpoint: the checkpoint's path (for messages).
    """

    def __init__(self, image_processor: Any, image_token_id: int, image_token: str, tokens_per_image: Any,
                 checkpoint: str) -> None:
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.image_token = image_token
        self.tokens_per_image = tokens_per_image
        self.checkpoint = checkpoint

    def __call__(self, token_ids: list[int], extra: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        """``(token_ids, extra)`` with placeholders expanded and ``images`` replaced by
        ``pixel_values`` and ``image_positions`` (see :mod:`modelrunner_mm.features`).

        :raises ValueError: the placeholder count differs from the image count, an image is not an
            image, or the checkpoint has no image processor.
        """
        images = _as_image_list(extra.get(IMAGES))
        rest = {k: v for k, v in extra.items() if k != IMAGES}
        placeholders = sum(1 for t in token_ids if t == self.image_token_id)
        if placeholders != len(images):
            raise ValueError(
                f"the prompt has {placeholders} image placeholder(s) ({self.image_token!r}, token id "
                f"{self.image_token_id}) but {len(images)} image(s) were given; put one {self.image_token} in "
                "the prompt for each image, in order"
            )
        if not images:
            return list(token_ids), rest
        if self.image_processor is None:
            raise ValueError(f"checkpoint {self.checkpoint} ships no image processor (preprocessor_config.json or "
                             "processor_config.json), so it cannot take images; save its processor with it")
        try:
            pixels = self.image_processor(images, return_tensors="pt")["pixel_values"]
        except Exception as e:  # the processor raises many types for unusable images
            raise ValueError(f"the image processor rejected the images: {type(e).__name__}: {e}") from e
        per_image = self.tokens_per_image(int(pixels.shape[-2]), int(pixels.shape[-1]))
        expanded: list[int] = []
        positions: list[int] = []
        for token in token_ids:
            if token == self.image_token_id:
                positions.extend(range(len(expanded), len(expanded) + per_image))
                expanded.extend([token] * per_image)
            else:
                expanded.append(token)
        rest[PIXEL_VALUES] = pixels
        rest[IMAGE_POSITIONS] = torch.tensor(positions, dtype=torch.long)
        return expanded, rest


def _as_image_list(images: Any) -> list[Any]:
    """``images`` as a list, each checked to be an image: PIL, or an ``[H, W, C]`` / ``[C, H, W]`` array."""
    import numpy as np
    from PIL import Image

    if images is None:
        return []
    if isinstance(images, (Image.Image, np.ndarray, torch.Tensor)):
        images = [images]
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"'images' must be a list of images, got {type(images).__name__}")
    for i, image in enumerate(images):
        if isinstance(image, Image.Image):
            continue
        if isinstance(image, (np.ndarray, torch.Tensor)) and image.ndim == 3:
            continue
        what = f"a {image.ndim}-d {type(image).__name__}" if hasattr(image, "ndim") else type(image).__name__
        raise ValueError(f"images[{i}] is {what}; accepted: PIL.Image.Image, or a 3-d numpy array / torch "
                         "tensor ([H, W, C] or [C, H, W])")
    return list(images)
