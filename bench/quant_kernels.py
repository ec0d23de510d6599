"""The quant-cpu plugin's matmul kernels on SmolLM2-135M's linear shapes, against float32 peers
measured in the same rounds: ``F.linear`` on the dequantized weight (MKL) and oneDNN's
``_linear_pointwise`` with a prepacked weight.

Each method has enough copies of its weight to overflow the CPU's caches (64 MB at least), cycled
call by call, so that as in a decode step the weights come from memory. Medians over alternating
rounds. Times are per call; GB/s at M=1 is the bytes of the method's weight (quantized: qweight +
scales + mins) over the time.

    python bench/quant_kernels.py             # 4-bit (group 32, mins) and 8-bit (group 32, no mins)
    python bench/quant_kernels.py --quick     # one shape, few rounds: to check that it runs
"""

from __future__ import annotations

import argparse
import statistics
import time

import modelrunner_quant_cpu as quant
import torch
import torch.nn.functional as F
from modelrunner_quant_cpu.reference import pack_nibbles

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
"""SmolLM2-135M's linear layers as N x K (q, k, v fused; gate and up fused)."""
ROWS = (1, 8, 64, 256)
STREAM_BYTES = 64 << 20


def quantized(N: int, K: int, bits: int, group: int, mins: bool, gen: torch.Generator):
    q = torch.randint(0, 16, (N, K), generator=gen) if bits == 4 else torch.randint(-128, 128, (N, K), generator=gen)
    qweight = pack_nibbles(q) if bits == 4 else q.to(torch.int8)
    scales = (torch.rand(N, K // group, generator=gen) * 0.01 + 0.001).half()
    lows = (-8 * scales.float()).half() if mins else None
    return qweight, scales, lows


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def copies_for(size: int) -> int:
    return max(2, min(64, -(-STREAM_BYTES // size)))


def weights_for(N: int, K: int, gen: torch.Generator) -> dict[str, tuple[list, int]]:
    """name -> (copies of the weight, bytes of one copy): Q4_1-like 4-bit (group 32, mins), Q8_0-like
    8-bit (group 32, no mins), and the float32 weight they stand for."""
    out = {}
    for bits, mins in ((4, True), (8, False)):
        one = quantized(N, K, bits, 32, mins, gen)
        size = nbytes(*one)
        out[f"w{bits}"] = ([one] + [tuple(t.clone() if t is not None else None for t in one)
                                    for _ in range(copies_for(size) - 1)], size)
    dense = quant.dequantize(*out["w4"][0][0], 32, 4)
    out["fp32"] = ([dense] + [dense.clone() for _ in range(copies_for(nbytes(dense)) - 1)], nbytes(dense))
    return out


def methods_for(weights: dict, M: int) -> dict[str, tuple[list, int, callable]]:
    """name -> (weights to cycle, bytes of one, call(x, weight))."""
    out = {}
    for bits in (4, 8):
        copies, size = weights[f"w{bits}"]
        for mode in ("exact", "q8"):
            out[f"w{bits} {mode}"] = (copies, size,
                                      lambda x, w, bits=bits, mode=mode: quant.qlinear(x, *w, 32, bits, mode=mode))
        rows = copies[0][0].shape[0]
        packed = [quant.pack_p16(*w, 32, bits) for w in copies]
        if quant.p16_supported(bits):  # q8's arithmetic on the weight regrouped in tiles of 16 rows
            out[f"w{bits} p16"] = (packed, size, lambda x, w, bits=bits, rows=rows:
                                   quant.bind_qlinear_p16(*w, rows, 32, bits)(x))
        if quant.p16_exact_supported(bits):  # exact's arithmetic on the same layout
            out[f"w{bits} p16 exact"] = (packed, size, lambda x, w, bits=bits, rows=rows:
                                         quant.bind_qlinear_p16_exact(*w, rows, 32, bits)(x))
        if quant.p16_split_supported(bits):  # exact too, x as three int8 digits
            out[f"w{bits} p16 split"] = (packed, size, lambda x, w, bits=bits, rows=rows:
                                         quant.bind_qlinear_p16_split(*w, rows, 32, bits)(x))
    dense, size = weights["fp32"]
    out["F.linear fp32"] = (dense, size, lambda x, w: F.linear(x, w))
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, M) for w in dense]
    out["oneDNN fp32"] = (packed, size, lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    return out


def time_case(weights: dict, K: int, M: int, rounds: int, gen: torch.Generator) -> dict[str, tuple[float, int]]:
    x = torch.randn(M, K, generator=gen)
    methods = methods_for(weights, M)
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for name, (copies, _, call) in methods.items():  # warm-up
        for w in copies[:2]:
            call(x, w)
    for _ in range(rounds):
        for name, (copies, _, call) in methods.items():
            calls = max(len(copies), 8)
            start = time.perf_counter()
            for i in range(calls):
                call(x, copies[i % len(copies)])
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: (statistics.median(samples[name]), methods[name][1]) for name in methods}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape, two row counts, few rounds")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not quant.available():
        raise SystemExit("the quant-cpu kernels do not build here")
    shapes = {"qkv": SHAPES["qkv"]} if args.quick else SHAPES
    rows = (1, 64) if args.quick else ROWS
    rounds = 2 if args.quick else args.rounds
    gen = torch.Generator().manual_seed(0)
    print(f"kernels: {quant.simd()}, threads: {torch.get_num_threads()}; w4: 4-bit, group 32, mins; "
          f"w8: 8-bit, group 32, no mins; us per call (GB/s of weight read at M=1)")
    names = None
    for label, (N, K) in shapes.items():
        weights = weights_for(N, K, gen)
        for M in rows:
            result = time_case(weights, K, M, rounds, gen)
            if names is None:
                names = list(result)
                print(f"{'shape':>20} {'M':>4} " + " ".join(f"{n:>14}" for n in names))
            cells = []
            for name in names:
                seconds, size = result[name]
                cell = f"{seconds * 1e6:.1f}"
                if M == 1:
                    cell += f" ({size / seconds / 1e9:.0f})"
                cells.append(f"{cell:>14}")
            print(f"{label + f' {N}x{K}':>20} {M:>4} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
