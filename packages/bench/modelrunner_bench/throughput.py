"""``bench throughput``: every prompt handed to the engine at once (offline), tokens per second."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .workload import Workload


def measure_throughput(llm: Any, workload: Workload) -> tuple[dict[str, float | int | None], list[list[int]]]:
    """Generate for every prompt of the workload in one ``LLM.generate`` call (continuous batching
    decides the steps), greedy (see :meth:`Workload.sampling_params`).

    :returns: the metrics (``elapsed_s``, ``requests_per_s``, ``output_tokens_per_s``,
        ``total_tokens_per_s`` (prompt and output tokens), ``prompt_tokens``, ``output_tokens``,
        ``median_ttft_s``, ``median_tpot_s``) and each prompt's generated token ids.
    """
    params = workload.sampling_params()
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False, lora_request=workload.lora_requests())
    elapsed = time.perf_counter() - start
    for out in outputs:
        if out.error:
            raise RuntimeError(f"a benchmark request failed: {out.error}")
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    output_tokens = sum(map(len, tokens))
    ttft = [out.metrics.time_to_first_token for out in outputs if out.metrics.time_to_first_token is not None]
    tpot = [out.metrics.time_per_output_token for out in outputs if out.metrics.time_per_output_token is not None]
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "median_ttft_s": statistics.median(ttft) if ttft else None,
        "median_tpot_s": statistics.median(tpot) if tpot else None,
    }, tokens
