"""Paged decode attention per attention backend, against the kernel's ``torch_sdpa``, on SmolLM2's
shapes (9 query heads, 3 kv heads, head size 64, 30 layers, blocks of 16) in float32 on the CPU.

One timed step is what a decode step's attention costs the model: ``build_metadata`` once, then for
each of 30 layers the backend's ``forward`` (store the new keys/values, attend). Every layer has its
own cache, so as in a real step the keys/values come from memory, not from the CPU's caches. The
backends run in alternating rounds in this process and the medians are compared.

    python bench/attention.py           # every installed backend that runs here
    python bench/attention.py --quick   # small sizes, to check that it runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from modelrunner import ForwardBatch
from modelrunner.layers import Attention
from modelrunner.plugins import get_plugins

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16
"""SmolLM2-135M's attention."""
CASES = [(1, 128), (1, 1024), (32, 128), (32, 512), (64, 128)]
"""(sequences, cached tokens per sequence) of the timed decode steps."""


def decode_step(num_seqs: int, context: int, seed: int = 0):
    """A decode step's batch, one query/key/value per sequence, and one filled cache per layer
    (each sequence's blocks consecutive, sequences one after another, as a fresh engine allocates)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = context // BLOCK + 1
    num_blocks = num_seqs * blocks_per_seq
    tables = torch.arange(num_blocks).view(num_seqs, blocks_per_seq)
    slots = tables[:, context // BLOCK] * BLOCK + context % BLOCK
    batch = ForwardBatch(
        input_ids=torch.zeros(num_seqs, dtype=torch.long),
        positions=torch.full((num_seqs,), context),
        seq_ids=tuple(range(num_seqs)),
        query_start_loc=torch.arange(num_seqs + 1),
        seq_lens=torch.full((num_seqs,), context + 1),
        context_lens=torch.full((num_seqs,), context),
        slot_mapping=slots,
        block_tables=tables,
        logits_indices=torch.arange(num_seqs),
        block_size=BLOCK,
        max_query_len=1,
        max_seq_len=context + 1,
    )
    caches = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
    qkv = (torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen), torch.randn(num_seqs, KV_HEADS, HEAD_DIM, generator=gen),
           torch.randn(num_seqs, KV_HEADS, HEAD_DIM, generator=gen))
    return batch, caches, qkv


def time_backends(names: list[str], num_seqs: int, context: int, rounds: int) -> dict[str, float]:
    """Median seconds of one decode step's attention (30 layers) per backend, in alternating rounds."""
    batch, caches, (query, key, value) = decode_step(num_seqs, context)
    layers = {n: Attention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, backend=get_plugins().attention_backend("cpu", n))
              for n in names}
    outputs = {}

    def step(layer: Attention) -> torch.Tensor:
        metadata = layer.backend.build_metadata(batch)
        for cache in caches:
            out = layer(query, key, value, cache, metadata)
        return out

    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():
        for n in names:
            outputs[n] = step(layers[n])
        for _ in range(rounds):
            for n in names:
                start = time.perf_counter()
                step(layers[n])
                times[n].append(time.perf_counter() - start)
    for n in names:  # the same answer, or the comparison means nothing
        torch.testing.assert_close(outputs[n], outputs["torch_sdpa"], atol=1e-4, rtol=1e-4)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few rounds (to check it runs)")
    args = parser.parse_args()
    get_plugins()  # installed plugins register their backends
    names = get_plugins().attention_backends("cpu")
    load1 = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {load1:.2f}; "
          f"backends: {', '.join(names)}")
    if load1 > 0.5:
        print(f"WARNING: load average {load1:.2f}: other processes compete for the CPU; numbers are noisy.")
    others = [n for n in names if n != "torch_sdpa"]
    cases = [(2, 32)] if args.quick else CASES
    print(f"{'sequences':>9} {'context':>7} {'torch_sdpa ms':>13} " + " ".join(f"{n + ' ms':>14} {'ratio':>6}" for n in others))
    for num_seqs, context in cases:
        medians = time_backends(names, num_seqs, context, rounds=3 if args.quick else 15)
        base = medians["torch_sdpa"]
        cells = " ".join(f"{medians[n] * 1e3:14.2f} {base / medians[n]:5.2f}×" for n in others)
        print(f"{num_seqs:>9} {context:>7} {base * 1e3:13.2f} {cells}", flush=True)
    print("ratio: torch_sdpa's time ÷ the backend's (above 1: the backend is faster), one decode step's "
          f"attention over {LAYERS} layers")


if __name__ == "__main__":
    main()
