"""LoRA's cost on the default model (SmolLM2-135M-Instruct, its GGUF read in place):

- throughput of a batch of 64 requests spread over 4 rank-16 adapters on q/k/v/o/gate/up/down,
  against the same batch on the base model, in alternating rounds in one LLM (target: at least 0.7x);
- adapter load time: reading and checking one adapter, from disk into the layers' format (median).

The adapters are random PEFT checkpoints written here (no peft needed), non-zero so their deltas are
really computed. Every request generates the same number of tokens (EOS ignored).

    python bench/lora.py           # batch 64, 64 tokens, 3 rounds
    python bench/lora.py --quick   # batch 8, 8 tokens, 1 round: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from modelrunner import LLM, LoRARequest, SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections every adapter targets."""


def write_adapter(hf_config, path: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA on every projection of ``hf_config``'s layers, written to ``path``."""
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    hidden, inter = text.hidden_size, text.intermediate_size
    head_dim = getattr(text, "head_dim", None) or hidden // text.num_attention_heads
    q, kv = text.num_attention_heads * head_dim, text.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(text.num_hidden_layers):
        for name in TARGETS:
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            d_in, d_out = shapes[name]
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))
    return path


def run_batch(llm: LLM, batch: int, params: SamplingParams, loras: list) -> tuple[float, int]:
    """(seconds, output tokens) of one batch."""
    prompts = [f"Write a short story about the number {i}." for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 8, 8 tokens, 1 round (checks that it runs)")
    parser.add_argument("--model", default="smollm2", help="the base model (default smollm2)")
    parser.add_argument("--lora-kernel", default="torch", help="the lora_kernels plugin to measure (default torch)")
    args = parser.parse_args()
    batch, tokens, rounds = (8, 8, 1) if args.quick else (64, 64, 3)
    adapters, rank = 4, 16
    llm = LLM(args.model, max_num_seqs=max(batch, 8), enable_lora=True, max_loras=adapters, max_lora_rank=rank,
              lora_kernel=args.lora_kernel)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hf_config = llm.runner.loaded.hf_config
            paths = [write_adapter(hf_config, Path(tmp) / f"a{i}", rank, seed=i) for i in range(adapters)]
            loads = []
            for i, path in enumerate(paths):
                start = time.perf_counter()
                llm.llm_engine.add_lora(LoRARequest(f"a{i}", i + 1, str(path)))
                loads.append(time.perf_counter() - start)
            spread = [LoRARequest(f"a{i % adapters}", i % adapters + 1, str(paths[i % adapters])) for i in range(batch)]
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            run_batch(llm, min(batch, 8), params, spread[:8])  # warm both paths
            run_batch(llm, min(batch, 8), params, None)
            rates: dict[str, list[float]] = {"lora": [], "base": []}
            for _ in range(rounds):
                for name, loras in (("lora", spread), ("base", None)):
                    seconds, generated = run_batch(llm, batch, params, loras)
                    rates[name].append(generated / seconds)
    finally:
        llm.shutdown()
    lora, base = statistics.median(rates["lora"]), statistics.median(rates["base"])
    print(f"{args.model}: batch {batch} over {adapters} rank-{rank} adapters (q/k/v/o/gate/up/down), {tokens} tokens "
          f"per request, median of {rounds} round(s), lora_kernel={args.lora_kernel}; target ratio >= 0.7")
    print("| LoRA batch tok/s | base batch tok/s | ratio | adapter load ms (median) |")
    print("|---:|---:|---:|---:|")
    print(f"| {lora:.1f} | {base:.1f} | {lora / base:.2f} | {1000 * statistics.median(loads):.1f} |")


if __name__ == "__main__":
    main()
