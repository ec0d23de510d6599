"""The default model (SmolLM2's GGUF as stored) on prompts and batches, against transformers, our own
dense path and llama.cpp, every peer measured in this run (issue 32's table).

- 256-token prompt to its first token, tokens/s: ours ÷ transformers ``generate``;
- batch 64 × 64 new tokens (64 prompts of 32 tokens), output tokens/s: ours ÷ transformers;
- batch 256 × 64, output tokens/s: ours ÷ our dense path (the file's float32 conversion, in bfloat16
  where the CPU computes it), and the dense path's share of this machine's matmul bound;
- single stream, 128 new tokens: ours ÷ llama.cpp on the same file (``make bench`` installs it).

Where the CPU has AMX or AVX512-BF16 the peers are transformers in bfloat16 (and float32) and our dense
bfloat16 path; elsewhere transformers in float32 and our dense float32 path. The targets printed are
the issue's for this kind of CPU. Peers alternate round by round (drift hits both), medians reported.

    python bench/fast_paths.py            # the full benchmark (~15 minutes on 2 cores)
    python bench/fast_paths.py --quick    # small sizes, to check that it runs
    python bench/fast_paths.py --model F  # another GGUF file (a Llama) in place of the default model's
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from quantized import LlamaCpp, Ours, alternate, random_prompts, summary  # noqa: E402
from throughput import MatmulBound, run_transformers  # noqa: E402

TARGETS_BF16 = {"prompt": 1.0, "batch 64": 1.5, "batch 256": 1.0, "dense bound": 0.5, "single": 1.2}
"""On CPUs with AMX or AVX512-BF16: ratios to transformers-bf16 (prompt, batch 64), to our dense bf16
path (batch 256), the dense path's fraction of the bf16 matmul bound, and to llama.cpp (single)."""
TARGETS_FP32 = {"prompt": 1.3, "batch 64": 1.3, "single": 1.2}
"""Elsewhere: ratios to transformers-fp32 (prompt, batch 64) and to llama.cpp (single)."""


class Transformers:
    """transformers' ``generate`` on the file's float32 conversion, in ``dtype``, sdpa attention."""

    def __init__(self, directory: str, dtype: torch.dtype, pad_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype,
                                                          attn_implementation="sdpa").eval()
        self.pad_id = pad_id

    def prompt_rate(self, prompt: list[int]) -> float:
        return len(prompt) / run_transformers(self.model, self.pad_id, [prompt], 1, 1)

    def batch_rate(self, prompts: list[list[int]], new_tokens: int) -> float:
        return len(prompts) * new_tokens / run_transformers(self.model, self.pad_id, prompts, new_tokens,
                                                            len(prompts))


def verdict(name: str, ratio: float, targets: dict[str, float]) -> str:
    target = targets.get(name)
    if target is None:
        return f"   {name}: {ratio:.2f}×  (no target on this CPU)"
    return f"   {name}: {ratio:.2f}×  (target ≥ {target:.1f}×: {'met' if ratio >= target else 'MISSED'})"


def median_ratio(values: dict[str, list[float]], ours: str, peer: str) -> float:
    return statistics.median(values[ours]) / statistics.median(values[peer])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few rounds, to check that it runs")
    parser.add_argument("--threads", type=int, default=2, help="threads for every peer (default 2)")
    parser.add_argument("--rounds", type=int, default=None, help="repetitions per measurement (default 3)")
    parser.add_argument("--model", default="smollm2",
                        help="the GGUF file to measure (default: smollm2, the default model's file)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (1 if args.quick else 3)
    prompt_len, batch, many, new_tokens, single = (64, 8, 16, 8, 16) if args.quick else (256, 64, 256, 64, 128)

    from modelrunner_quantization.library import cpu_flags, native_bf16
    from modelrunner.loading.source import resolve_source
    from modelrunner.timing_cache import cpu_model

    bf16 = native_bf16()
    targets = TARGETS_BF16 if bf16 else TARGETS_FP32
    flags = sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"})
    load1 = os.getloadavg()[0]
    print(f"{cpu_model()} ({', '.join(flags)}); torch {torch.__version__}, {args.threads} threads on "
          f"{os.cpu_count()} cores; load average {load1:.2f}")
    if load1 > 0.5:
        print(f"WARNING: load average {load1:.2f} before the run: other processes compete for the CPU")
    dense_dtype = torch.bfloat16 if bf16 else torch.float32
    dense_name = "bfloat16" if bf16 else "float32"
    print(f"bfloat16 in hardware: {'yes' if bf16 else 'no'}: peers are transformers-{dense_name} and our dense "
          f"{dense_name} path")

    source = resolve_source(args.model)
    path, dense_dir = str(source.path), str(source.directory)
    source.release_weights()
    ours = Ours(args.model, None)
    dense = Ours(dense_dir, None)
    if bf16:
        from modelrunner import LLM

        dense.llm = LLM(dense_dir, dtype="bfloat16")
    tokenizer = ours.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf = Transformers(dense_dir, dense_dtype, pad_id)
    print(f"ours: {getattr(ours.llm.runner.runner, 'dtype', '?')} activations; kernels {ours.kernels}")
    vocab = len(tokenizer)
    results: dict[str, float] = {}

    print(f"\n== one {prompt_len}-token prompt to its first token, tokens/s")
    prompts = iter(random_prompts(vocab, 3 * rounds + 3, prompt_len, seed=2))
    ours.prompt_rate(next(prompts))  # warm-up: first calls allocate and pick kernels
    hf.prompt_rate(next(prompts))
    values = alternate({"ours": lambda: ours.prompt_rate(next(prompts)),
                        f"transformers-{dense_name}": lambda: hf.prompt_rate(next(prompts))}, rounds)
    for label, v in values.items():
        print(f"   {label:<22} {summary(v)}")
    results["prompt"] = median_ratio(values, "ours", f"transformers-{dense_name}")
    print(verdict("prompt", results["prompt"], targets))

    print(f"\n== batch {batch} × {new_tokens} new tokens ({batch} prompts of 32 tokens), output tokens/s")
    prompts64 = random_prompts(vocab, batch, 32, seed=3)
    hf.batch_rate(prompts64[:2], 2)
    values = alternate({"ours": lambda: ours.batch_rate(prompts64, new_tokens),
                        f"transformers-{dense_name}": lambda: hf.batch_rate(prompts64, new_tokens)}, rounds)
    for label, v in values.items():
        print(f"   {label:<22} {summary(v)}")
    results["batch 64"] = median_ratio(values, "ours", f"transformers-{dense_name}")
    print(verdict("batch 64", results["batch 64"], targets))
    del hf

    print(f"\n== batch {many} × {new_tokens} new tokens ({many} prompts of 32 tokens), output tokens/s")
    prompts256 = random_prompts(vocab, many, 32, seed=4)
    values = alternate({"ours": lambda: ours.batch_rate(prompts256, new_tokens),
                        f"dense {dense_name}": lambda: dense.batch_rate(prompts256, new_tokens)},
                       max(1, rounds - 1))
    for label, v in values.items():
        print(f"   {label:<22} {summary(v)}")
    results["batch 256"] = median_ratio(values, "ours", f"dense {dense_name}")
    print(verdict("batch 256", results["batch 256"], targets))
    bound = MatmulBound(_hf_config(dense_dir), dtype=dense_dtype)
    tokens_per_s = statistics.median(values[f"dense {dense_name}"])
    gflops = bound.flops(many, many) / many * tokens_per_s / 1e9
    peak = bound.flops(many, many) / bound.step_seconds(many, many) / 1e9
    results["dense bound"] = gflops / peak
    print(f"   dense {dense_name}: {gflops:.0f} GFLOP/s in its linear layers; {dense_name} GEMM at {many} rows: "
          f"{bound.describe(many, many)}")
    print(verdict("dense bound", results["dense bound"], targets))

    try:
        peer = LlamaCpp(path, args.threads)
    except ImportError:
        print("\nllama-cpp-python is not installed (`make bench` installs it): skipping the single stream")
        peer = None
    if peer is not None:
        print(f"\n== single stream: {single} new tokens after 8 prompt tokens, decode tokens/s")
        short = random_prompts(vocab, 1, 8, seed=1)[0]
        values = alternate({"ours": lambda: ours.decode_rate(short, single),
                            "llama.cpp": lambda: peer.decode_rate(short, single)}, rounds + 2)
        for label, v in values.items():
            print(f"   {label:<22} {summary(v)}")
        results["single"] = median_ratio(values, "ours", "llama.cpp")
        print(verdict("single", results["single"], targets))

    after = os.getloadavg()[0]
    if after > args.threads + 0.5:
        print(f"WARNING: load average {after:.2f} after the run: the machine was busy; numbers are noisy")
    print("\nsummary: " + ", ".join(f"{k} {v:.2f}×" for k, v in results.items()))
    return 0


def _hf_config(directory: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


if __name__ == "__main__":
    sys.exit(main())
