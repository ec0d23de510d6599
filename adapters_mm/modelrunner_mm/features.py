"""Image features per sequence, and the step's input embeddings with them written in.

A request's images are encoded the first time a prefill chunk reaches one of its image tokens
(all of its images at once, batched with other sequences' images of the same size), kept while
its prompt is prefilled chunk by chunk, and dropped once the chunk holding its last image token
ran, or when the sequence ends or is preempted (``batch.finished_seq_ids``; a recomputed prompt
encodes its images again). Decode steps never touch the vision tower.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

PIXEL_VALUES = "pixel_values"
"""``batch.extra`` key: ``{seq_id: [num_images, C, H, W] float pixels}`` (from ``process_inputs``)."""
IMAGE_POSITIONS = "image_positions"
"""``batch.extra`` key: ``{seq_id: [num_image_tokens] int64 prompt positions of the image tokens,
ascending}``; image ``k``'s features fill its ``k``-th run of ``tokens_per_image`` positions."""


class ImageFeatureCache:
    """Projected image features ``[num_image_tokens, hidden]`` of each sequence that still needs them."""

    def __init__(self) -> None:
        self.features: dict[int, torch.Tensor] = {}
        """Sequence id → its images' features, in prompt order."""
        self.images_encoded = 0
        """Images run through the vision tower since loading."""

    def stats(self) -> dict[str, int]:
        """``images_encoded`` and ``sequences_with_image_features`` (those whose prefill is under way)."""
        return {"images_encoded": self.images_encoded, "sequences_with_image_features": len(self.features)}

    def forget(self, seq_ids: tuple[int, ...] | list[int]) -> None:
        """Drop the features of sequences that ended or were preempted."""
        for seq_id in seq_ids:
            self.features.pop(seq_id, None)

    def input_embeddings(self, model: Any, batch: Any) -> torch.Tensor | None:
        """The step's input embeddings with image features at the image tokens it holds, or None
        when no sequence's chunk holds an image token (then token ids alone describe the step).

        :param model: the :class:`~modelrunner_mm.model.LlavaForConditionalGeneration`.
        :param batch: the step's :class:`~modelrunner.forward_batch.ForwardBatch`.
        """
        self.forget(batch.finished_seq_ids)
        positions_of: dict[int, torch.Tensor] = batch.extra.get(IMAGE_POSITIONS) or {}
        if not positions_of:
            return None
        starts = batch.query_start_loc.tolist()
        context = batch.context_lens.tolist()
        spans = []  # (seq id, rows of the flat batch, indices into its features, last image token reached)
        for i, seq_id in enumerate(batch.seq_ids):
            positions = positions_of.get(seq_id)
            if positions is None or positions.numel() == 0:
                continue
            first, end = context[i], context[i] + starts[i + 1] - starts[i]
            inside = ((positions >= first) & (positions < end)).nonzero().flatten()
            if inside.numel():
                spans.append((seq_id, starts[i] + positions[inside] - first, inside, end > int(positions[-1])))
        if not spans:
            return None
        self._encode([s[0] for s in spans if s[0] not in self.features], batch.extra.get(PIXEL_VALUES) or {},
                     positions_of, model)
        embeds = model.embed_input_ids(batch.input_ids)
        for seq_id, rows, which, last_reached in spans:
            features = self.features[seq_id]
            embeds[rows.to(embeds.device)] = features[which.to(features.device)].to(embeds.dtype)
            if last_reached:
                del self.features[seq_id]
        return embeds

    def _encode(self, seq_ids: list[int], pixels_of: dict[int, torch.Tensor],
                positions_of: dict[int, torch.Tensor], model: Any) -> None:
        """Encode the images of ``seq_ids``: one vision-tower call per distinct image size."""
        missing = [s for s in seq_ids if s not in pixels_of]
        if missing:
            raise ValueError(f"sequence(s) {missing} have image tokens but no {PIXEL_VALUES!r} in batch.extra")
        by_size: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for seq_id in seq_ids:
            by_size[tuple(pixels_of[seq_id].shape[1:])].append(seq_id)
        weight = next(model.vision_tower.parameters())
        for group in by_size.values():
            pixels = [pixels_of[s] for s in group]
            features = model.encode_images(torch.cat(pixels).to(weight.device, weight.dtype))
            self.images_encoded += features.shape[0]
            for seq_id, mine in zip(group, features.split([p.shape[0] for p in pixels])):
                flat = mine.reshape(-1, mine.shape[-1])
                wanted = positions_of[seq_id].numel()
                if flat.shape[0] != wanted:
                    raise ValueError(f"sequence {seq_id}: its {mine.shape[0]} image(s) gave {flat.shape[0]} feature "
                                     f"rows but the prompt has {wanted} image tokens")
                self.features[seq_id] = flat
