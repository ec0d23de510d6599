"""Speculative decoding with a tensor-parallel target (TP=2): the verification runs on the sharded
target and gives one process's greedy tokens; a draft model runs unsharded in the driver process
(the target's process group is the process's one), with its own KV cache."""

from __future__ import annotations

from modelrunner import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 17, 5, 9, 17, 5, 9], [3, 44, 21, 8, 3, 44, 21]]
CONFIG = dict(dtype="float32", device="cpu", kv_cache_memory=2 << 20, max_model_len=128)


def test_tp2_target_with_a_draft_model_gives_one_process_tokens(tiny_llama):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = LLM(str(tiny_llama), **CONFIG)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.shutdown()
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **CONFIG, speculative_config={
        "model": str(tiny_llama), "num_speculative_tokens": 3, "disable_by_batch_size": None})
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()["speculative"]
    finally:
        llm.shutdown()
    assert got == want
    assert stats["num_accepted_tokens"] > 10, stats  # the target drafting for itself: accepted
