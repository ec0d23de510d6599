"""One Mixtral-style MoE block: modelrunner's router + FusedMoE against transformers' own block, same weights.

The block: hidden 1024, 8 experts of intermediate 1792 (Mixtral's 8 × top-2 routing at a quarter
of its width, so the 176 MB of fp32 expert weights fit this 2-core CPU's time budget), float32.
Ours runs as a loaded model does under the default ``eager`` backend: expert weights prepacked for oneDNN.
Both sides get the same hidden states and weights and must agree (max |difference| is printed).
transformers' ``MixtralSparseMoeBlock`` runs with each of its experts implementations:
``grouped_mm`` (its default since 5.x, ``torch.nn.functional.grouped_mm``) and ``eager`` (its
per-expert loop). Ours is :class:`modelrunner.layers.fused_moe.FusedMoE` behind the same router.

Timing alternates ours and theirs call by call and takes medians, so load from other processes
hits both sides alike; the ratio is tokens/second ours ÷ theirs.

    python bench/moe_layer.py            # 1, 16 and 256 tokens
    python bench/moe_layer.py --quick    # fewer repetitions, to check that it runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 1024, 1792, 8, 2
TOKENS = (1, 16, 256)


def build(seed: int = 0):
    """``(ours, {implementation: transformers block})`` sharing one set of random weights."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from modelrunner.layers.dense import prepack_weights
    from modelrunner.layers.fused_moe import FusedMoE

    torch.manual_seed(seed)
    gate = torch.randn(EXPERTS, HIDDEN) * HIDDEN**-0.5
    w13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * INTERMEDIATE**-0.5

    ours_experts = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, renormalize=True)
    ours_experts.w13_weight.weight_loader(ours_experts.w13_weight, w13)
    ours_experts.w2_weight.weight_loader(ours_experts.w2_weight, w2)
    prepack_weights(ours_experts)  # as the cpu_fused compile backend does for a loaded model

    def ours(hidden: torch.Tensor) -> torch.Tensor:
        return ours_experts(hidden, torch.nn.functional.linear(hidden, gate))

    theirs = {}
    for implementation in ("grouped_mm", "eager"):
        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
                               num_experts_per_tok=TOP_K)
        config._experts_implementation = implementation
        block = MixtralSparseMoeBlock(config).eval()
        with torch.no_grad():
            block.gate.weight.copy_(gate)
            block.experts.gate_up_proj.copy_(w13)
            block.experts.down_proj.copy_(w2)
        theirs[implementation] = lambda h, b=block: b(h.unsqueeze(0))[0]
    return ours, theirs


def time_alternating(fns: dict[str, object], hidden: torch.Tensor, budget_s: float) -> dict[str, float]:
    """Median seconds per call of each function, calling them in turn until ``budget_s`` is spent."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn(hidden)
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or min(len(t) for t in times.values()) < 5:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(hidden)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short timing budget (to check it runs)")
    args = parser.parse_args()
    load1 = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {load1:.2f}; "
          f"block: hidden {HIDDEN}, {EXPERTS} experts × intermediate {INTERMEDIATE}, top-{TOP_K}, float32")
    if load1 > 0.5:
        print(f"WARNING: load average {load1:.2f}: other processes compete for the CPU; numbers are noisy.")
    ours, theirs = build()
    budget = 0.5 if args.quick else 4.0
    rows = []
    with torch.inference_mode():
        for tokens in TOKENS:
            hidden = torch.randn(tokens, HIDDEN)
            expected = theirs["eager"](hidden)
            diff = max((ours(hidden) - expected).abs().max().item(),
                       (theirs["grouped_mm"](hidden) - expected).abs().max().item())
            med = time_alternating({"ours": ours, **theirs}, hidden, budget)
            rows.append((tokens, med, diff))
    print(f"\n{'tokens':>6} | {'ours tok/s':>10} | {'hf grouped_mm tok/s':>19} | {'hf eager tok/s':>14} | "
          f"{'ours ÷ grouped_mm':>17} | {'ours ÷ eager':>12} | max |diff|")
    print("-" * 104)
    for tokens, med, diff in rows:
        ours_tps = tokens / med["ours"]
        print(f"{tokens:>6} | {ours_tps:>10.1f} | {tokens / med['grouped_mm']:>19.1f} | "
              f"{tokens / med['eager']:>14.1f} | "
              f"{med['grouped_mm'] / med['ours']:>16.2f}× | {med['eager'] / med['ours']:>11.2f}× | {diff:.1e}")
    print("\nTarget: ≥ 1× at every size and ≥ 2× at 256 tokens against transformers' default (grouped_mm).")
    print(matmul_ceiling(budget))


def matmul_ceiling(budget_s: float) -> str:
    """This machine's fp32 rate on one expert's gate/up product at 256 tokens' share (64 rows):
    the bound both blocks run against, through MKL (``F.linear``, transformers) and oneDNN (ours)."""
    from modelrunner.layers.dense import dense

    x, w = torch.randn(2 * 256 // EXPERTS, HIDDEN), torch.randn(2 * INTERMEDIATE, HIDDEN)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    with torch.inference_mode():
        med = time_alternating({"mkl": lambda h: torch.nn.functional.linear(h, w),
                                "onednn": lambda h: dense(h, w),
                                "packed": lambda h: dense(h, w, packed=packed)}, x, budget_s / 2)
    flops = 2 * x.shape[0] * w.shape[0] * w.shape[1]
    return (f"fp32 matmul [{x.shape[0]}×{HIDDEN}]·[{HIDDEN}×{2 * INTERMEDIATE}] on this machine now: "
            f"F.linear (MKL) {flops / med['mkl'] / 1e9:.0f} GFLOP/s, oneDNN {flops / med['onednn'] / 1e9:.0f}, "
            f"oneDNN prepacked {flops / med['packed'] / 1e9:.0f} — the experts' matmuls are ~95% of either "
            "block's time, so the ratio at 256 tokens is bounded by the packed ÷ MKL rate.")


if __name__ == "__main__":
    main()
