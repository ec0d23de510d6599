"""The real default model: the adapter's greedy continuations equal transformers' generate, token for token."""

from __future__ import annotations

import pytest
import torch

from modelrunner.config import RunnerConfig
from modelrunner.plugins import get_plugins
from modelrunner_kit.testing import PagedDriver, load_adapter

NEW_TOKENS = 64

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1492,",
    "Water boils at",
    "Here is my favourite recipe for a quick weeknight dinner. First, you",
    "Q: What is 2+2?\nA:",
]


@pytest.mark.slow
def test_greedy_batch_matches_transformers_generate(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = load_adapter(smollm2_dir, RunnerConfig(), plugins=get_plugins(allow=["llama"]))
    loaded = model.loaded
    assert loaded.adapter == "llama"
    tokenizer = loaded.tokenizer
    prompts = {i: tokenizer(text)["input_ids"] for i, text in enumerate(PROMPTS)}
    assert len({len(p) for p in prompts.values()}) >= 6  # genuinely mixed lengths
    eos = tokenizer.eos_token_id

    # All eight prompts prefilled in one step, then decoded together. EOS is suppressed (as
    # transformers' min_new_tokens does) so every continuation runs the full 64 tokens.
    driver = PagedDriver(model.forward, loaded.kv_cache_spec, num_blocks=8 * 8)
    ours = driver.greedy(prompts, NEW_TOKENS, suppress=[eos])

    reference = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = reference.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
    theirs = out[:, batch["input_ids"].shape[1]:].tolist()

    for i, text in enumerate(PROMPTS):
        assert ours[i] == theirs[i], (
            f"prompt {i} {text!r} diverges at token {next(j for j, (a, b) in enumerate(zip(ours[i], theirs[i])) if a != b)}:\n"
            f"  ours:         {tokenizer.decode(ours[i])!r}\n  transformers: {tokenizer.decode(theirs[i])!r}"
        )
