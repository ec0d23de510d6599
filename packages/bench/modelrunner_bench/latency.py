"""``bench latency``: one batch through the engine, step by step — prefill time and per-step decode time."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .workload import Workload


def measure_latency(llm: Any, workload: Workload) -> tuple[dict[str, float | int | None], list[list[int]]]:
    """Run the workload's prompts as one batch, timing each engine step.

    The batch is added at once; *prefill* lasts until every request has its first token (several
    steps when the prompts exceed ``max_num_batched_tokens``), every later step is a *decode step*.
    Sampling is greedy with EOS ignored (except by prompts a dataset constrains), so every run does
    the same work.

    :returns: the metrics (``latency_s``, ``prefill_s``, ``prefill_steps``, ``decode_step_s`` (median
        step), ``decode_step_mean_s``, ``decode_steps``, ``output_tokens_per_s``) and each prompt's
        generated token ids.
    """
    engine = llm.engine
    done: dict[str, Any] = {}
    started: set[str] = set()

    def consume(output: Any) -> None:
        if output.outputs and output.outputs[0].token_ids:
            started.add(output.request_id)
        if output.finished:
            done[output.request_id] = output

    ids = []
    start = time.perf_counter()
    loras = workload.lora_requests() or [None] * len(workload.prompts)
    for prompt, params, lora in zip(workload.prompts, workload.sampling_params(), loras):
        rid = engine.new_request_id()
        engine.add_request(rid, prompt, params, on_output=consume, lora_request=lora)
        ids.append(rid)
    prefill_s, prefill_steps, decode = 0.0, 0, []
    try:
        while len(done) < len(ids):
            prefilling = len(started) < len(ids)  # this step may still give some request its first token
            t = time.perf_counter()
            engine.advance()
            elapsed = time.perf_counter() - t
            if prefilling:
                prefill_s += elapsed
                prefill_steps += 1
            else:
                decode.append(elapsed)
    except BaseException:
        for rid in ids:
            engine.abort_request(rid)
        raise
    latency = time.perf_counter() - start
    outputs = [done[rid] for rid in ids]
    for out in outputs:
        if out.error:
            raise RuntimeError(f"a benchmark request failed: {out.error}")
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    return {
        "latency_s": latency,
        "prefill_s": prefill_s,
        "prefill_steps": prefill_steps,
        "decode_step_s": statistics.median(decode) if decode else None,
        "decode_step_mean_s": statistics.fmean(decode) if decode else None,
        "decode_steps": len(decode),
        "output_tokens_per_s": sum(map(len, tokens)) / latency,
    }, tokens
