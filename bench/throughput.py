"""Throughput of modelrunner's engine against transformers' ``generate``, on SmolLM2 fp32 on the CPU.

Every number is measured in this run: ours, transformers' on the same weights, and this machine's
own limits at the same shapes (fp32 matmul time of the model's linear layers for the batched runs,
weight-read bandwidth for batch 1), with the fastest kernel it has (MKL's, which transformers runs,
or oneDNN's on prepacked weights, which modelrunner runs). The bound of a run is the time its matmuls alone would take:
the prompt tokens at the prefill rows, then one decode step per new token at the batch's rows.

    python bench/throughput.py            # the full benchmark (a few minutes on 2 cores)
    python bench/throughput.py --quick    # small sizes, to check that it runs
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

WORDS = (
    "river mountain engine garden science history music ocean window letter market planet winter "
    "teacher forest bridge language city dragon number machine coffee village island storm castle "
    "kitchen library garden harbor painting question journey lantern orchard theory violin desert "
    "meadow signal station compass silver thunder candle mirror feather canyon puzzle festival"
).split()
STARTS = ["Tell me about", "Write a poem on", "Explain why", "Describe a", "Summarize the story of",
          "List facts about", "What is the", "Imagine a", "Compare the", "Give advice on"]


def machine_report() -> None:
    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    load1, load5, _ = os.getloadavg()
    print(f"torch {torch.__version__}, {threads} threads on {cores} cores; load average {load1:.2f} (1 min), "
          f"{load5:.2f} (5 min)")
    check_contention("before the run")


def check_contention(when: str) -> None:
    load1 = os.getloadavg()[0]
    if load1 > 0.5 and when == "before the run" or load1 > torch.get_num_threads() + 0.5:
        print(f"WARNING: load average {load1:.2f} {when}: other processes compete for the CPU, so these "
              "numbers are low and noisy (2-thread matmuls starve under contention). Rerun on a quiet machine.")


def make_prompts(tokenizer: Any, count: int, seed: int, low: int = 28, high: int = 36) -> list[list[int]]:
    """``count`` different prompts of ``low``–``high`` tokens of plain English-ish text."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = " ".join(rng.choice(WORDS) for _ in range(60))
        text = f"{rng.choice(STARTS)} {words} (request {i})"
        prompts.append(tokenizer.encode(text)[: rng.randint(low, high)])
    return prompts


# -- this machine's limits ------------------------------------------------------------------------


class MatmulBound:
    """Times the model's fp32 linear layers (fused qkv / gate_up, o, down; LM head) as bare matmuls,
    with each kernel this machine has: ``F.linear`` (MKL, what transformers runs) and oneDNN on
    prepacked weights (what modelrunner's eager backend runs). The bound is the faster of the two.
    With ``dtype=torch.bfloat16``: ``F.linear`` in bfloat16 (oneDNN's, AMX where present) alone."""

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32) -> None:
        from modelrunner.layers.dense import onednn_usable

        c = hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        h, i = c.hidden_size, c.intermediate_size
        qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
        shapes = [(qkv, h), (h, c.num_attention_heads * head_dim), (2 * i, h), (h, i)]
        self.num_layers = c.num_hidden_layers
        # Every layer its own weights, as in the model: reused ones would be read from the CPU's cache.
        self.dtype = dtype
        self.layers = [[torch.empty(shape, dtype=dtype).normal_() for shape in shapes] for _ in range(self.num_layers)]
        self.lm_head = torch.empty(c.vocab_size, h, dtype=dtype).normal_()
        self.hidden, self.inter = h, i
        self.layer_params = sum(o * k for o, k in shapes)
        self.kernels: dict[str, tuple[list[list[Any]], Any, Any]] = {
            "MKL": (self.layers, self.lm_head, torch.nn.functional.linear)}
        if onednn_usable() and dtype == torch.float32:
            pack = torch.ops.mkldnn._reorder_linear_weight

            def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

            self.kernels["oneDNN packed"] = ([[pack(w) for w in layer] for layer in self.layers], pack(self.lm_head),
                                             onednn)
        self._cache: dict[tuple[int, int], dict[str, float]] = {}

    def _layer_inputs(self, rows: int) -> list[torch.Tensor]:
        return [torch.randn(rows, w.shape[1], dtype=self.dtype) for w in self.layers[0]]

    def kernel_seconds(self, rows: int, lm_rows: int) -> dict[str, float]:
        """Seconds for one step's matmuls with each kernel: every layer at ``rows`` rows, the LM head
        at ``lm_rows``."""
        key = (rows, lm_rows)
        if key not in self._cache:
            xs = self._layer_inputs(rows)
            x_lm = torch.randn(lm_rows, self.hidden, dtype=self.dtype)
            result = {}
            with torch.inference_mode():
                for name, (layers, head, linear) in self.kernels.items():
                    times = []
                    for _ in range(3 if rows > 1 else 10):
                        t = time.perf_counter()
                        for weights in layers:
                            for x, w in zip(xs, weights):
                                linear(x, w)
                        linear(x_lm, head)
                        times.append(time.perf_counter() - t)
                    result[name] = min(times)
            self._cache[key] = result
        return self._cache[key]

    def step_seconds(self, rows: int, lm_rows: int) -> float:
        """Seconds for one step's matmuls with the fastest kernel."""
        return min(self.kernel_seconds(rows, lm_rows).values())

    def describe(self, rows: int, lm_rows: int) -> str:
        """Each kernel's GFLOP/s at these rows."""
        return ", ".join(f"{name} {self.flops(rows, lm_rows) / s / 1e9:.0f}"
                         for name, s in self.kernel_seconds(rows, lm_rows).items()) + " GFLOP/s"

    def flops(self, rows: int, lm_rows: int) -> float:
        """Floating-point operations of one step's matmuls."""
        return 2.0 * (rows * self.layer_params * self.num_layers + lm_rows * self.lm_head.numel())

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads."""
        return self.lm_head.element_size() * (self.layer_params * self.num_layers + self.lm_head.numel())

    def run_seconds(self, batch: int, prompt_tokens: int, new_tokens: int, prefill_rows: int = 2048) -> float:
        """Matmul-only time of a whole run: prefill in chunks of ``prefill_rows``, then decode steps."""
        chunk = min(prefill_rows, prompt_tokens)
        chunks = prompt_tokens / chunk
        prefill = chunks * self.step_seconds(chunk, min(batch, chunk))
        decode = (new_tokens - 1) * self.step_seconds(batch, batch)
        return prefill + decode


# -- the two engines --------------------------------------------------------------------------------


def run_ours(llm: Any, prompts: list[list[int]], new_tokens: int) -> float:
    from modelrunner import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return elapsed


def run_transformers(model: Any, pad_id: int, prompts: list[list[int]], new_tokens: int, batch: int) -> float:
    """Padded (left) batched greedy ``generate`` in batches of ``batch`` prompts."""
    elapsed = 0.0
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, p in enumerate(group):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
        elapsed += time.perf_counter() - t
        assert out.shape[1] == width + new_tokens
    return elapsed


# -- reporting ----------------------------------------------------------------------------------------


def report(title: str, rows: list[tuple[str, float, float | None]], tokens: int, ratio_of: tuple[str, str],
           target: float) -> float:
    print(f"\n== {title}")
    rates = {}
    for name, seconds, bound in rows:
        rate = tokens / seconds
        rates[name] = rate
        frac = f"   {100 * bound / seconds:5.1f}% of this machine's matmul bound" if bound else ""
        print(f"   {name:<24} {rate:8.1f} output tok/s  ({seconds:6.2f} s){frac}")
    ratio = rates[ratio_of[0]] / rates[ratio_of[1]]
    verdict = "met" if ratio >= target else "MISSED"
    print(f"   ratio {ratio_of[0]} ÷ {ratio_of[1]}: {ratio:.2f}×  (target ≥ {target}×: {verdict})")
    return ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: check that the benchmark runs")
    args = parser.parse_args(argv)
    quick = args.quick
    batch, many, new_tokens, single_tokens = (8, 16, 8, 16) if quick else (64, 256, 64, 128)
    prefix_len, prefix_requests, prefix_new = (64, 8, 4) if quick else (256, 32, 16)

    from transformers import AutoModelForCausalLM

    from modelrunner import LLM
    from modelrunner.loading.source import resolve_source

    machine_report()
    source = resolve_source("smollm2")
    t = time.perf_counter()
    llm = LLM("smollm2", dtype="float32", device="cpu", max_model_len=2048, kv_cache_memory=2 * 2**30)
    print(f"modelrunner loaded SmolLM2 ({llm.runner.loaded.adapter} adapter) in {time.perf_counter() - t:.1f} s; "
          f"max_num_seqs={llm.runner.config.scheduler.max_num_seqs}, "
          f"max_num_batched_tokens={llm.runner.config.scheduler.max_num_batched_tokens}")
    hf = AutoModelForCausalLM.from_pretrained(str(source.directory), dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bound = MatmulBound(hf.config)

    # Warm both up (first calls allocate and pick kernels).
    warm = make_prompts(tokenizer, 2, seed=99)
    run_ours(llm, warm, 2)
    run_transformers(hf, pad_id, warm, 2, 2)

    results = {}
    # 1. offline batch
    prompts = make_prompts(tokenizer, batch, seed=1)
    ptoks = sum(map(len, prompts))
    ours = run_ours(llm, prompts, new_tokens)
    theirs = run_transformers(hf, pad_id, prompts, new_tokens, batch)
    b = bound.run_seconds(batch, ptoks, new_tokens)
    results["batch"] = report(
        f"offline batch: {batch} prompts × ~32 tokens → {new_tokens} new tokens each (greedy, EOS ignored)",
        [("modelrunner", ours, b), ("transformers (padded)", theirs, b)], batch * new_tokens,
        ("modelrunner", "transformers (padded)"), 1.6)
    rows, lm = batch, batch
    print(f"   matmul bound: {bound.describe(rows, lm)} at "
          f"{rows} rows ({rows / bound.step_seconds(rows, lm):.0f} tok/s decode-only), "
          f"{bound.flops(min(2048, ptoks), batch) / bound.step_seconds(min(2048, ptoks), batch) / 1e9:.0f} GFLOP/s "
          f"at {min(2048, ptoks)} prefill rows; whole-run bound {b:.2f} s")
    check_contention("after the batch run")

    # 2. many prompts
    prompts = make_prompts(tokenizer, many, seed=2)
    ptoks = sum(map(len, prompts))
    ours = run_ours(llm, prompts, new_tokens)
    theirs = run_transformers(hf, pad_id, prompts, new_tokens, batch)
    b = bound.run_seconds(many, ptoks, new_tokens)
    results["many"] = report(
        f"{many} prompts, same shape (ours: one engine run; transformers: batches of {batch})",
        [("modelrunner", ours, b), (f"transformers (×{many // batch} batches)", theirs, None)], many * new_tokens,
        ("modelrunner", f"transformers (×{many // batch} batches)"), 2.0)
    print(f"   matmul bound: {bound.describe(many, many)} at "
          f"{many} rows ({many / bound.step_seconds(many, many):.0f} tok/s decode-only); whole-run bound {b:.2f} s")
    check_contention("after the many-prompts run")

    # 3. single stream
    prompt = make_prompts(tokenizer, 1, seed=3)
    ours = run_ours(llm, prompt, single_tokens)
    theirs = run_transformers(hf, pad_id, prompt, single_tokens, 1)
    step1 = bound.step_seconds(1, 1)
    b = bound.run_seconds(1, len(prompt[0]), single_tokens)
    results["single"] = report(
        f"single stream: 1 prompt, {single_tokens} new tokens",
        [("modelrunner", ours, b), ("transformers", theirs, b)], single_tokens,
        ("modelrunner", "transformers"), 1.3)
    rates = ", ".join(f"{name} {bound.weight_bytes() / s / 1e9:.1f}" for name, s in bound.kernel_seconds(1, 1).items())
    print(f"   weight-read bound: {rates} GB/s reading {bound.weight_bytes() / 1e6:.0f} MB per token "
          f"→ {1 / step1:.1f} tok/s")
    check_contention("after the single-stream run")

    # 4. shared prefix: caching on ÷ off
    system = make_prompts(tokenizer, 1, seed=4, low=prefix_len * 2, high=prefix_len * 2)[0][:prefix_len]
    questions = make_prompts(tokenizer, prefix_requests, seed=5, low=12, high=20)
    prompts = [system + q for q in questions]
    ours = run_ours(llm, prompts, prefix_new)
    cached = llm.memory_stats()
    del llm
    no_cache = LLM("smollm2", dtype="float32", device="cpu", max_model_len=2048, kv_cache_memory=2 * 2**30,
                   enable_prefix_caching=False)
    run_ours(no_cache, warm, 2)
    off = run_ours(no_cache, prompts, prefix_new)
    results["prefix"] = report(
        f"shared prefix: {prefix_requests} requests sharing a {prefix_len}-token system prompt, "
        f"{prefix_new} new tokens each",
        [("prefix caching on", ours, None), ("prefix caching off", off, None)], prefix_requests * prefix_new,
        ("prefix caching on", "prefix caching off"), 2.0)
    print(f"   prefix hit rate (whole run, on): {cached['prefix_hit_rate']:.2f}")
    check_contention("at the end")

    print("\nsummary: " + ", ".join(f"{k} {v:.2f}×" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
