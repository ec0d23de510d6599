"""A tiny random LLaVA (2-layer CLIP vision tower, 2-layer Llama) saved with its processor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

IMAGE_TOKEN = "<image>"
"""The placeholder added to SmolLM2's tokenizer."""
IMAGE_SEQ_LENGTH = 16
"""Tokens per 32×32 image: (32 / 8)² patches (the class token is dropped)."""


def save_tiny_llava(path: Path, tokenizer_dir: Path, seed: int = 0):
    """Build, save and return ``(model, processor)``: every weight random and non-trivial
    (norms near 1, everything else ~0.1), so the parity tests compare real numbers."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tok), max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         image_seq_length=IMAGE_SEQ_LENGTH)
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=8,
                               vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                               num_additional_image_tokens=1)
    processor.save_pretrained(str(path))
    return model, processor


def random_image(seed: int, size: tuple[int, int] = (40, 48)):
    """A random RGB PIL image (not square, so the processor resizes and crops)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))
