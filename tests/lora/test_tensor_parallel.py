"""LoRA under tensor parallelism: the A/B matrices split the way their layers split (q/k/v heads,
gate/up features, o/down input columns with the deltas all-reduced), and the worker rank reads each
adapter from the first step that uses it."""

from __future__ import annotations

from modelrunner import LLM, LoRARequest, SamplingParams

PROMPTS = [list(range(100, 120)), list(range(200, 209)), list(range(300, 313))]


def test_tp2_mixed_batch_matches_one_process(lora_llm, tiny_llama_dir, peft_adapters):
    loras = [LoRARequest("a", 1, str(peft_adapters[0])), LoRARequest("b", 2, str(peft_adapters[1])), None]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in lora_llm.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", device="cpu", kv_cache_memory=2 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == want
    assert len({tuple(t) for t in got}) == 3
