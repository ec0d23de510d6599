"""Data parallelism's cost on the default model (SmolLM2-135M-Instruct), all in this run:

- throughput of a batch of 64 greedy requests on DP=2 replicas of one thread each against one engine
  (DP=1) on two threads, in alternating rounds (on 2 cores the point is the overhead, not a speed-up);
- the router's added latency per request: the median time of a lone one-token request through a
  front with one replica process, minus the same request on an engine in this process (same threads).

    python bench/data_parallel.py           # batch 64, 64 tokens, 3 rounds, 20 lone requests
    python bench/data_parallel.py --quick   # batch 8, 8 tokens, 1 round, 3 lone requests: checks that it runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from modelrunner import LLM, SamplingParams
from modelrunner_data_parallel import DataParallelLLM

PROMPT = "Write a short story about a robot learning to paint, number {i}."


def run_batch(llm: LLM, batch: int, tokens: int) -> float:
    """Output tokens per second of one batch."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([PROMPT.format(i=i) for i in range(batch)], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def lone_latency(llm: LLM, count: int) -> float:
    """Median seconds of ``count`` one-token requests, one at a time."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate("warm up", params, use_tqdm=False)
    times = []
    for i in range(count):
        start = time.perf_counter()
        llm.generate(f"Hello {i}", params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 8, 8 tokens, 1 round (checks that it runs)")
    args = parser.parse_args()
    batch, tokens, rounds, lone = (8, 8, 1, 3) if args.quick else (64, 64, 3, 20)
    os.environ["OMP_NUM_THREADS"] = "1"  # what each replica process runs with
    torch.set_num_threads(2)  # the in-process engine: both cores
    config = dict(max_num_seqs=max(batch, 8))
    dp2 = LLM("smollm2", data_parallel_size=2, **config)
    one = LLM("smollm2", **config)
    try:
        rates: dict[str, list[float]] = {"dp2": [], "dp1": []}
        run_batch(dp2, 8, 4)
        run_batch(one, 8, 4)
        for _ in range(rounds):
            rates["dp2"].append(run_batch(dp2, batch, tokens))
            rates["dp1"].append(run_batch(one, batch, tokens))
        in_process = lone_latency(one, lone)
    finally:
        dp2.shutdown()
    os.environ["OMP_NUM_THREADS"] = "2"
    front = DataParallelLLM("smollm2", data_parallel_size=1, **config)  # one replica process behind the router
    try:
        routed = lone_latency(front, lone)
    finally:
        front.shutdown()
        one.shutdown()
    dp2_rate, dp1_rate = statistics.median(rates["dp2"]), statistics.median(rates["dp1"])
    print(f"batch {batch}, {tokens} tokens per request, median of {rounds} round(s); {os.cpu_count()} CPUs")
    print("| setup | tok/s | vs DP=1 x 2 threads |")
    print("|---|---:|---:|")
    print(f"| DP=2 x 1 thread | {dp2_rate:.1f} | {dp2_rate / dp1_rate:.2f}x |")
    print(f"| DP=1 x 2 threads | {dp1_rate:.1f} | 1.00x |")
    print(f"router's added latency per request (median of {lone} one-token requests): "
          f"{1000 * (routed - in_process):.1f} ms ({1000 * routed:.1f} ms routed, {1000 * in_process:.1f} ms in process)")


if __name__ == "__main__":
    main()
