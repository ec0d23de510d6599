"""KV-cache capacity of the installed allocators for one memory budget.

1. Concurrency: sequences of realistic lengths are admitted at their full length (prompt + output)
   until the allocator refuses; how many run at once, and how much reserved memory holds no token.
   Reported as the ratio paged ÷ contiguous, measured in the same run.
2. Prefix caching: requests sharing a system prompt; the fraction of prompt tokens served from cache.

Run: ``python bench/kv_capacity.py`` (a few seconds; CPU only, no model needed).
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

from modelrunner.config import CacheConfig
from modelrunner.kv_cache import BlockAllocator, KVCacheSpec, num_blocks_for_budget
from modelrunner.plugins import create_allocator, get_registry

SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32, block_size=16)
"""SmolLM2-135M's KV cache."""
BUDGET = 256 * 2**20
MAX_MODEL_LEN = 2048
TRIALS = 20
PROMPT_MEDIAN, OUTPUT_MEDIAN, SIGMA = 300, 150, 0.8
SYSTEM_PROMPT_LEN, NUM_REQUESTS, SUFFIX_MEDIAN = 256, 32, 48


def make(name: str, num_blocks: int, prefix_caching: bool) -> BlockAllocator:
    config = CacheConfig(block_size=SPEC.block_size, kv_allocator=name, enable_prefix_caching=prefix_caching)
    return create_allocator(name, num_blocks, SPEC.block_size, MAX_MODEL_LEN, config)


def lognormal(rng: random.Random, median: int) -> int:
    return max(1, round(rng.lognormvariate(math.log(median), SIGMA)))


def sequence_lengths(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(MAX_MODEL_LEN, lognormal(rng, PROMPT_MEDIAN) + lognormal(rng, OUTPUT_MEDIAN)) for _ in range(4096)]


def admit_until_refused(allocator: BlockAllocator, lengths: list[int]) -> tuple[int, float]:
    """Sequences admitted at full length before the first refusal, and the reserved fraction left empty."""
    admitted = 0
    for seq_id, length in enumerate(lengths):
        tokens = range(seq_id * MAX_MODEL_LEN, seq_id * MAX_MODEL_LEN + length)  # no shared prefixes
        if not allocator.can_allocate(tokens):
            break
        allocator.allocate(seq_id, tokens)
        admitted += 1
    return admitted, allocator.stats().fragmentation


def decode_cost_us(name: str, num_seqs: int = 64, prompt_len: int = 64, steps: int = 256) -> float:
    """Microseconds per ``append_slots`` call while ``num_seqs`` sequences decode one token at a time.

    The pool is large enough for every sequence at full length, so only the bookkeeping is timed.
    """
    allocator = make(name, num_seqs * -(-MAX_MODEL_LEN // SPEC.block_size), prefix_caching=True)
    for s in range(num_seqs):
        allocator.allocate(s, [s] * prompt_len)
    start = time.perf_counter()
    for step in range(steps):
        for s in range(num_seqs):
            allocator.append_slots(s, [step])
    return (time.perf_counter() - start) / (num_seqs * steps) * 1e6


def shared_prompt_workload(name: str, num_blocks: int, prefix_caching: bool) -> tuple[float, float, int]:
    """Hit rate, the best possible hit rate, and peak blocks, for requests sharing a system prompt."""
    rng = random.Random(1)
    system = [rng.randrange(49152) for _ in range(SYSTEM_PROMPT_LEN)]
    allocator = make(name, num_blocks, prefix_caching)
    total = reusable = 0
    live: list[int] = []
    for req in range(NUM_REQUESTS):
        prompt = system + [49152 + req * MAX_MODEL_LEN + i for i in range(lognormal(rng, SUFFIX_MEDIAN))]
        while not allocator.can_allocate(prompt) and live:
            allocator.free(live.pop(0))  # the oldest request finishes
        allocator.allocate(req, prompt)
        live.append(req)
        total += len(prompt)
        reusable += SYSTEM_PROMPT_LEN // SPEC.block_size * SPEC.block_size if req else 0
    stats = allocator.stats()
    return stats.prefix_hit_rate, reusable / total, stats.peak_used_blocks


def main() -> None:
    num_blocks = num_blocks_for_budget(SPEC, BUDGET, MAX_MODEL_LEN)
    names = get_registry().names("allocators")
    print(
        f"KV budget {BUDGET / 2**20:.0f} MiB, SmolLM2-135M spec ({SPEC.num_layers} layers, {SPEC.num_kv_heads} kv heads, "
        f"head dim {SPEC.head_dim}, float32): {SPEC.bytes_per_token:,} B/token, {num_blocks} blocks of "
        f"{SPEC.block_size}, max_model_len {MAX_MODEL_LEN}"
    )
    print(
        f"Sequence lengths: lognormal prompt (median {PROMPT_MEDIAN}) + output (median {OUTPUT_MEDIAN}), "
        f"sigma {SIGMA}, admitted at full length until the first refusal; mean of {TRIALS} seeded trials\n"
    )
    print(f"{'allocator':<12} {'running at once':>16} {'min..max':>10} {'reserved, empty':>16} {'decode µs/token':>16}")
    concurrency: dict[str, float] = {}
    for name in names:
        runs = [admit_until_refused(make(name, num_blocks, prefix_caching=False), sequence_lengths(t))
                for t in range(TRIALS)]
        counts = [n for n, _ in runs]
        concurrency[name] = statistics.mean(counts)
        waste = statistics.mean(w for _, w in runs)
        print(f"{name:<12} {concurrency[name]:>16.1f} {f'{min(counts)}..{max(counts)}':>10} {waste:>16.1%} "
              f"{decode_cost_us(name):>16.2f}")
    if "paged" in concurrency and concurrency.get("contiguous"):
        print(f"\npaged ÷ contiguous concurrency: {concurrency['paged'] / concurrency['contiguous']:.1f}x")

    print(
        f"\nShared system prompt: {NUM_REQUESTS} requests, {SYSTEM_PROMPT_LEN}-token system prompt + distinct "
        f"user suffix (lognormal, median {SUFFIX_MEDIAN})\n"
    )
    print(f"{'allocator':<12} {'prefix caching':>15} {'hit rate':>9} {'best possible':>14} {'peak blocks':>12}")
    for name in names:
        supported = make(name, num_blocks, prefix_caching=True).enable_prefix_caching
        for prefix_caching in (True, False) if supported else (False,):
            hit_rate, best, peak = shared_prompt_workload(name, num_blocks, prefix_caching)
            mode = "on" if prefix_caching else "off" if supported else "unsupported"
            print(f"{name:<12} {mode:>15} {hit_rate:>9.1%} {best:>14.1%} {peak:>12}")


if __name__ == "__main__":
    main()
