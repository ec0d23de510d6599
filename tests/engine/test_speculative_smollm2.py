"""Speculative decoding on the real SmolLM2-135M (float32): ``ngram`` and a (tiny, random) draft model
give plain decoding's greedy outputs, for copy-heavy and ordinary prompts in one batch with requests
that do not speculate."""

from __future__ import annotations

import pytest

from modelrunner import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. Again: the quick brown fox",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Copy this list: apples, pears, plums. Copy: apples,",
    "The capital of France is",
    "List three colors:",
    "Hello, my name is",
    "Once upon a time, in a land far away,",
]


def test_ngram_and_draft_greedy_equal_plain_on_smollm2(smollm2_dir, tiny_llama_dir):
    kw = dict(device="cpu", dtype="float32", max_model_len=512, kv_cache_memory=64 * 2**20)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS + ["Name a fruit:", "Write the word blue:"]
    params = [greedy] * len(PROMPTS) + [  # these two use logits processors: they do not speculate
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logit_bias={11: 2.0}),
        SamplingParams(max_tokens=16, temperature=0.0, min_tokens=4)]
    plain = LLM(str(smollm2_dir), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(smollm2_dir), **kw, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                          "prompt_lookup_max": 3,
                                                          "disable_by_batch_size": None})
    spec = llm.generate(prompts, params, use_tqdm=False)
    for prompt, a, b in zip(prompts, plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, prompt
    assert all(o.metrics.spec_num_drafts == 0 for o in spec[len(PROMPTS):])
    stats = llm.llm_engine.stats()["speculative"]
    assert stats["num_accepted_tokens"] > 10, stats
    # A tiny random draft with SmolLM2's vocabulary: mostly rejected, never wrong.
    llm = LLM(str(smollm2_dir), **kw, speculative_config={"model": str(tiny_llama_dir), "num_speculative_tokens": 3,
                                                                 "disable_by_batch_size": None})
    drafted = llm.generate(prompts, params, use_tqdm=False)
    for prompt, a, b in zip(prompts, plain, drafted):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, prompt
    assert llm.llm_engine.stats()["speculative"]["num_drafts"] > 0
