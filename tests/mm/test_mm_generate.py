"""Images through ``LLM.generate``: greedy continuations equal transformers' ``generate``, batched with
text-only requests; prefix caching tells images apart."""

from __future__ import annotations

import torch

from modelrunner import SamplingParams
from modelrunner.llm import LLM

from .checkpoint import random_image

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
"""Greedy; both sides stop early at EOS (never reached by this random model in 8 tokens)."""


def _reference_continuation(model, processor, text: str, images: list, new_tokens: int = NEW_TOKENS) -> list[int]:
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_greedy_matches_transformers_batched_with_text_only(tiny_llava, llava_llm):
    _, reference, processor = tiny_llava
    requests = [
        ("USER: <image>\nDescribe it. ASSISTANT:", [random_image(1)]),
        ("A text-only prompt to the same model", []),
        ("Left <image> right <image>, which is brighter?", [random_image(2), random_image(3)]),
        ("<image>", [random_image(4)]),
    ]
    prompts = [{"prompt": text, "images": images} if images else text for text, images in requests]
    before = llava_llm.runner.stats()["model"]["images_encoded"]
    outputs = llava_llm.generate(prompts, GREEDY, use_tqdm=False)
    for (text, images), output in zip(requests, outputs):
        assert output.error is None and len(output.outputs[0].token_ids) == NEW_TOKENS
        assert output.outputs[0].token_ids == _reference_continuation(reference, processor, text, images), text
    stats = llava_llm.runner.stats()["model"]
    assert stats["images_encoded"] - before == 4  # once per image although prompts were prefilled in chunks
    assert stats["sequences_with_image_features"] == 0


def test_prefix_cache_reuses_only_the_same_image(tiny_llava):
    llm = LLM(model=str(tiny_llava[0]), dtype="float32", block_size=4, kv_cache_memory=4 << 20)
    text = "USER: <image>\nWhat colour dominates this picture? ASSISTANT:"
    first = llm.generate({"prompt": text, "images": [random_image(10)]}, GREEDY, use_tqdm=False)[0]
    other = llm.generate({"prompt": text, "images": [random_image(11)]}, GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0  # same tokens, different image: nothing shared
    hits_before = llm.memory_stats()["prefix_hits"]
    again = llm.generate({"prompt": text, "images": [random_image(10)]}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 4  # every full block of the prompt reused
    assert llm.memory_stats()["prefix_hits"] > hits_before
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids  # the image does change the answer


def test_preempted_image_requests_encode_again_and_still_match(tiny_llava):
    _, reference, processor = tiny_llava
    block_bytes = 2 * 2 * 2 * 16 * 4 * 4  # K and V × layers × kv heads × head dim × float32 × block of 4
    llm = LLM(model=str(tiny_llava[0]), dtype="float32", block_size=4, kv_cache_memory=24 * block_bytes,
              max_model_len=48, max_num_batched_tokens=8)
    requests = [(f"USER: <image>\nImage number {i}? ASSISTANT:", [random_image(100 + i)]) for i in range(4)]
    longer = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = llm.generate([{"prompt": t, "images": im} for t, im in requests], longer, use_tqdm=False)
    preemptions = llm.memory_stats()["num_preemptions"]
    assert preemptions > 0  # 4 sequences of 27 + 12 tokens cannot all fit in 24 blocks of 4
    assert llm.runner.stats()["model"] == {"images_encoded": 4 + preemptions, "sequences_with_image_features": 0}
    for (text, images), output in zip(requests, outputs):
        assert output.outputs[0].token_ids == _reference_continuation(reference, processor, text, images, 12)
