"""Embedding throughput on the default model (SmolLM2-135M-Instruct, its GGUF read in place): a batch
of 64 embedding requests (``LLM.embed``, last-token pooling, normalised) against the prefill of the
same prompts (``LLM.generate`` with ``max_tokens=1``), in alternating rounds in one LLM. Both compute
every prompt token once; the embedding keeps each prompt's last hidden state where the prefill
computes its logits and samples a token. Target: at least 0.9x the prefill's prompt tokens per second.

    python bench/embeddings.py           # batch 64, prompts of ~100-200 tokens, 5 rounds
    python bench/embeddings.py --quick   # batch 8, 1 round: checks that it runs
"""

from __future__ import annotations

import argparse
import statistics
import time

from modelrunner import LLM, SamplingParams

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "under bright northern lights near old stone bridges").split()


def prompts(batch: int) -> list[str]:
    """``batch`` different prompts of about 100 to 200 tokens each."""
    return [f"Document {i}: " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(80 + (i * 37) % 90))
            for i in range(batch)]


def run(llm: LLM, texts: list[str], embed: bool) -> tuple[float, int]:
    """(seconds, prompt tokens) of one batch, embedded or prefilled."""
    start = time.perf_counter()
    if embed:
        outs = llm.embed(texts, use_tqdm=False)
    else:
        outs = llm.generate(texts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.prompt_token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 8, 1 round (checks that it runs)")
    parser.add_argument("--model", default="smollm2", help="the model (default smollm2)")
    args = parser.parse_args()
    batch, rounds = (8, 1) if args.quick else (64, 5)
    # No prefix caching: each round computes every prompt token again, for both kinds of request.
    llm = LLM(args.model, max_num_seqs=max(batch, 8), enable_prefix_caching=False)
    texts = prompts(batch)
    try:
        run(llm, texts[:8], embed=True)  # warm both paths
        run(llm, texts[:8], embed=False)
        rates: dict[str, list[float]] = {"embed": [], "prefill": []}
        for _ in range(rounds):
            for name in ("embed", "prefill"):
                seconds, tokens = run(llm, texts, embed=name == "embed")
                rates[name].append(tokens / seconds)
    finally:
        llm.shutdown()
    embed, prefill = statistics.median(rates["embed"]), statistics.median(rates["prefill"])
    print(f"{args.model}: batch {batch}, {tokens} prompt tokens per batch, median of {rounds} round(s), "
          f"pooling {llm.llm_engine.pooler.method_name}; target ratio >= 0.9")
    print("| embed prompt tok/s | prefill (max_tokens=1) prompt tok/s | ratio |")
    print("|---:|---:|---:|")
    print(f"| {embed:.1f} | {prefill:.1f} | {embed / prefill:.2f} |")


if __name__ == "__main__":
    main()
