"""One workload run the same way on one process, on a parallel group, and under torchrun.

Six greedy requests of mixed lengths through ``LLM.generate`` with at most three running at once
and 16-token prefill chunks: requests queue, join while others decode, long prompts prefill in
several steps, two prompts share a cached prefix, and one request forks two completions (a KV block
copy). Then the logits of every position of one prompt through ``runner.forward``.
"""

from __future__ import annotations

from typing import Any

import torch

LLM_KW = dict(dtype="float32", device="cpu", kv_cache_memory=2 << 20, max_model_len=128, block_size=4,
              max_num_seqs=3, max_num_batched_tokens=16)
"""Small cache, few sequences at once and short prefill chunks, so requests queue, join mid-run and
prompts are prefilled in several chunks: continuous batching in every test."""

PROMPTS = [
    [5, 9, 2, 77, 31, 8, 100],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6],
    [7, 7],
    [3, 1, 4, 1, 5, 9, 2, 6, 42, 43],  # shares two full blocks with prompt 1
    [11, 12, 13, 14, 15],
    [200, 100, 50, 25, 12, 6, 3, 1, 250],
]
MAX_TOKENS = [6, 9, 12, 20, 15, 7]
LOGITS_PROMPT = PROMPTS[1]


def run_workload(llm: Any) -> dict[str, Any]:
    """Token ids of every completion (prompt 3 asks for two) and ``[len(LOGITS_PROMPT), vocab]`` logits."""
    from modelrunner import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, n=2 if i == 3 else 1)
              for i, m in enumerate(MAX_TOKENS)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    errors = [o.error for o in outputs if o.error]
    assert not errors, errors
    tokens = [[c.token_ids for c in o.outputs] for o in outputs]
    logits = llm.runner.forward(torch.tensor(LOGITS_PROMPT))[0]
    return {"tokens": tokens, "logits": logits}
