"""The quantized-matmul candidates on SmolLM2-135M's linear shapes: the quant-cpu plugin's hand-written
SIMD kernels against the library kernels (torch's packed int4 and int8 weight-only ops, with bfloat16
and with float32 activations; oneDNN's bf16 GEMM on a bf16 working copy and on a kept bf16 weight) and
float32 peers (``F.linear`` on the dequantized weight, oneDNN's ``_linear_pointwise`` prepacked), all
measured in the same rounds.

Three weight formats: ``w4`` 4-bit groups of 32 with mins (GGUF Q4_0/Q4_1, ``int4``), ``w8`` 8-bit
groups of 32 (GGUF Q8_0), ``w8r`` 8-bit, one scale per row (the ``int8`` method; the only int8 format
torch's ``_weight_int8pack_mm`` takes). Each method has enough copies of its weight to overflow the
CPU's caches (64 MB at least), cycled call by call, so that as in a decode step the weights come from
memory. Medians over alternating rounds; a round of a slow method stops after ``--budget`` seconds
(one call at least). Times are us per call; GB/s at M=1 is the bytes the method reads per call (its
weight as stored: values + scales (+ mins)) over the time. The float32-activation forms of torch's
packed ops are timed at up to 8 rows only (tens of times slower).

Then, per format and row count, the fastest hand-written kernel against the fastest library one
(``C++ ÷ lib`` < 1: the C++ is faster; the issue's rule keeps C++ only where it is ≤ 1/1.15 = 0.87 of
every library candidate), and — with ``--select`` (default on, off with ``--quick``) — what the real
kernel selector with ``activations="auto"`` picks per shape and bucket on this machine.

    python bench/quant_kernels.py             # every shape, M = 1, 8, 64, 256
    python bench/quant_kernels.py --quick     # one shape, two row counts, few rounds: to check that it runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import modelrunner_quant_cpu as quant
import torch
import torch.nn.functional as F
from modelrunner.quantization import QuantizedWeight, WeightFormat
from modelrunner_quantization.library import OneDNNBF16, TorchInt4Pack, TorchInt8Pack, int4pack_order, native_bf16
from modelrunner_quant_cpu.reference import pack_nibbles

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
"""SmolLM2-135M's linear layers as N x K (q, k, v fused; gate and up fused)."""
ROWS = (1, 8, 64, 256)
STREAM_BYTES = 64 << 20
FP32_ACTIVATION_ROWS = 8
"""The packed ops with float32 activations are timed up to this many rows."""
HAND_WRITTEN, LIBRARY, DENSE = "hand-written", "library", "dense"
UNTIMED = "library*"
"""A library kernel the selector does not time on this CPU (onednn_bf16 without native bf16): shown,
left out of the verdicts."""


def quantized(N: int, K: int, bits: int, group: int, mins: bool, gen: torch.Generator):
    q = torch.randint(0, 16, (N, K), generator=gen) if bits == 4 else torch.randint(-127, 128, (N, K), generator=gen)
    qweight = pack_nibbles(q) if bits == 4 else q.to(torch.int8)
    scales = (torch.rand(N, K // group, generator=gen) * 0.01 + 0.001).half()
    lows = (-8 * scales.float()).half() if mins else None
    return qweight, scales, lows


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def copies_for(size: int) -> int:
    return max(2, min(64, -(-STREAM_BYTES // size)))


def clones(one: tuple, count: int) -> list[tuple]:
    return [one] + [tuple(t.clone() if t is not None else None for t in one) for _ in range(count - 1)]


class Method:
    """One candidate: its weights to cycle, the bytes it reads per call, how to call it, its kind."""

    def __init__(self, fmt: str, kind: str, weights: list, size: int, call: Callable, max_rows: int | None = None):
        self.fmt, self.kind, self.weights, self.size = fmt, kind, weights, size
        self.call, self.max_rows = call, max_rows


def methods_for(N: int, K: int, gen: torch.Generator) -> dict[str, Method]:
    """name -> :class:`Method` for one shape (every row count)."""
    out: dict[str, Method] = {}
    formats = {"w4": (4, 32, True), "w8": (8, 32, False), "w8r": (8, K, False)}
    planar = {}
    for fmt, (bits, group, mins) in formats.items():
        one = quantized(N, K, bits, group, mins, gen)
        size = nbytes(*one)
        copies = planar[fmt] = clones(one, copies_for(size))
        for mode in ("exact", "q8"):
            out[f"{fmt} cpu {mode}"] = Method(fmt, HAND_WRITTEN, copies, size, lambda x, w, g=group, b=bits, m=mode:
                                              quant.qlinear(x, *w, g, b, mode=m))
        packed = [quant.pack_p16(*w, group, bits) for w in copies]
        for label, ok, bind in (("p16", quant.p16_supported, quant.bind_qlinear_p16),
                                ("p16 exact", quant.p16_exact_supported, quant.bind_qlinear_p16_exact),
                                ("p16 split", quant.p16_split_supported, quant.bind_qlinear_p16_split)):
            if ok(bits):
                out[f"{fmt} cpu {label}"] = Method(fmt, HAND_WRITTEN, [bind(*w, N, group, bits) for w in packed], size,
                                                   lambda x, f: f(x))
        weights = [QuantizedWeight(*w, WeightFormat(bits, group, mins, group == K), N, K) for w in copies]
        working = OneDNNBF16()  # dequantized to bf16 on every call (bounded), then F.linear
        out[f"{fmt} onednn_bf16"] = Method(fmt, LIBRARY if OneDNNBF16.timed else UNTIMED, weights, size,
                                           lambda x, w, k=working: k.run(w, x))
    if int4pack_order() is not None:
        kernel = TorchInt4Pack()
        packed4 = [QuantizedWeight(*TorchInt4Pack.pack(w), WeightFormat(4, 32, True), N, K, "int4pack")
                   for w in (QuantizedWeight(*p, WeightFormat(4, 32, True), N, K) for p in planar["w4"])]
        size4 = nbytes(packed4[0].data, packed4[0].scales)  # what the op reads (not the exact float16 copy)
        out["w4 torch_int4pack"] = Method("w4", LIBRARY, [kernel.bind(w) for w in packed4], size4, lambda x, f: f(x))
        fp32 = [(w.data, w.scales.float()) for w in packed4]
        out["w4 int4pack fp32-act"] = Method("w4", LIBRARY, fp32, size4 * 2 - nbytes(packed4[0].data),
                                             lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], 32, w[1]),
                                             FP32_ACTIVATION_ROWS)
    kernel8 = TorchInt8Pack()
    rows8 = [QuantizedWeight(*w, WeightFormat(8, K, False, True), N, K) for w in planar["w8r"]]
    out["w8r torch_int8pack"] = Method("w8r", LIBRARY, [kernel8.bind(w) for w in rows8], nbytes(*planar["w8r"][0]),
                                       lambda x, f: f(x))
    out["w8r int8pack fp32-act"] = Method("w8r", LIBRARY, [(w.data, w.scales.reshape(-1).float()) for w in rows8],
                                          nbytes(*planar["w8r"][0]),
                                          lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w[0], w[1]),
                                          FP32_ACTIVATION_ROWS)
    dense = quant.dequantize(*planar["w4"][0], 32, 4)
    dense_copies = [dense] + [dense.clone() for _ in range(copies_for(nbytes(dense)) - 1)]
    out["F.linear fp32"] = Method("dense", DENSE, dense_copies, nbytes(dense), lambda x, w: F.linear(x, w))
    out["oneDNN fp32 prepacked"] = Method("dense", DENSE, dense_copies, nbytes(dense), None)  # packed per M below
    bf16 = [w.to(torch.bfloat16) for w in dense_copies[:copies_for(nbytes(dense) // 2)]]
    out["oneDNN bf16 kept copy"] = Method("dense", DENSE, bf16, nbytes(bf16[0]),
                                          lambda x, w: F.linear(x.to(torch.bfloat16), w).float())
    return out


def time_case(methods: dict[str, Method], K: int, M: int, rounds: int, budget: float,
              gen: torch.Generator) -> dict[str, float]:
    """name -> median seconds per call at ``M`` rows."""
    x = torch.randn(M, K, generator=gen)
    runs: dict[str, tuple[list, Callable]] = {}
    for name, m in methods.items():
        if m.max_rows is not None and M > m.max_rows:
            continue
        if m.call is None:  # oneDNN's fp32 linear, its weight prepacked for this M
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, M) for w in m.weights]
            runs[name] = (packed, lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
        else:
            runs[name] = (m.weights, m.call)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for copies, call in runs.values():  # warm-up
        for w in copies[:2]:
            call(x, w)
    for _ in range(rounds):
        for name, (copies, call) in runs.items():
            calls = max(len(copies), 8)
            start = time.perf_counter()
            done = 0
            while done < calls:
                call(x, copies[done % len(copies)])
                done += 1
                if time.perf_counter() - start > budget:
                    break
            samples[name].append((time.perf_counter() - start) / done)
    return {name: statistics.median(s) for name, s in samples.items()}


def verdicts(methods: dict[str, Method], result: dict[str, float]) -> list[str]:
    """Per format: the fastest hand-written kernel against the fastest library one."""
    lines = []
    for fmt in ("w4", "w8", "w8r"):
        def best(kind: str, fmt: str = fmt) -> tuple[str, float] | None:
            timed = {n: t for n, t in result.items() if methods[n].fmt == fmt and methods[n].kind == kind}
            return min(timed.items(), key=lambda kv: kv[1]) if timed else None
        cpp, lib = best(HAND_WRITTEN), best(LIBRARY)
        if cpp and not lib:
            lines.append(f"{fmt}: best C++ {cpp[0]} {cpp[1] * 1e6:.1f} us; no library candidate is timed for it here")
        elif cpp and lib:
            ratio = cpp[1] / lib[1]
            keep = "C++ keeps it (>= 15% faster)" if ratio <= 1 / 1.15 else "library"
            lines.append(f"{fmt}: best C++ {cpp[0]} {cpp[1] * 1e6:.1f} us, best library {lib[0]} {lib[1] * 1e6:.1f} us,"
                         f" C++ / lib {ratio:.2f} -> {keep}")
    return lines


def selection(shapes: dict[str, tuple[int, int]]) -> None:
    """What the kernel selector picks with ``activations="auto"`` (all installed plugins' kernels)."""
    from torch import nn

    from modelrunner_quantization.kernels import KernelSelector
    from modelrunner_quantization.planar import PlanarScheme
    from modelrunner.quantization.planar_layout import quantize_planar

    print("\nselection with activations='auto' (the kernel's selector, every installed kernel, this machine):")
    for label, (bits, group, mins) in {"Q4 g32 mins (Q4_0/Q4_1/int4)": (4, 32, True),
                                       "Q8_0 (int8 g32)": (8, 32, False), "int8 per row": (8, 0, False)}.items():
        selector = KernelSelector("auto")
        for name, (N, K) in shapes.items():
            scheme = PlanarScheme(bits, group, has_mins=mins, kernels=selector, quantize_floats=True,
                                  symmetric=not mins)
            layer = nn.Module()
            layer.weight = nn.Parameter(torch.empty(N, K, device="meta"), requires_grad=False)
            scheme.create_storage(layer, N, K)
            q, scales, lows = quantize_planar(torch.randn(N, K) * 0.05, bits, scheme.group_size, not mins)
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight.logical_shape = (N, K)
            layer.weight_scales = nn.Parameter(scales, requires_grad=False)
            layer.weight_mins = None if lows is None else nn.Parameter(lows, requires_grad=False)
            layer.quant_scheme = scheme
            selector.prepare(scheme, layer)
            chosen = {b: selector.choices[selector.key(scheme, layer, b)] for b in ("decode", "batch")}
            timings = {b: selector.timings.get(selector.key(scheme, layer, b), {}) for b in ("decode", "batch")}
            family = selector.families.get(selector.key(scheme, layer, "any"), "(one family)")
            shown = "; ".join(f"{b}: {chosen[b]} [" + ", ".join(f"{n} {t * 1e6:.0f}" for n, t in
                                                                  sorted(timings[b].items(), key=lambda kv: kv[1]))
                              + "]" for b in chosen)
            print(f"  {label:<30} {name + f' {N}x{K}':<20} family {family:<16} {shown}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape, two row counts, few rounds, no selection")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.1,
                        help="seconds a method's round may take (one call at least)")
    parser.add_argument("--no-select", action="store_true", help="skip the selector's picks")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not quant.available():
        raise SystemExit("the quant-cpu kernels do not build here")
    shapes = {"qkv": SHAPES["qkv"]} if args.quick else SHAPES
    rows = (1, 64) if args.quick else ROWS
    rounds = 2 if args.quick else args.rounds
    gen = torch.Generator().manual_seed(0)
    print(f"quant-cpu kernels: {quant.simd()}; threads: {torch.get_num_threads()}; torch {torch.__version__}; "
          f"native bf16 (amx_bf16/avx512_bf16): {native_bf16()}; int4pack order: {int4pack_order()}")
    print("w4: 4-bit g32 mins; w8: 8-bit g32; w8r: 8-bit per row; us per call (GB/s of weight read at M=1)")
    summary = []
    for label, (N, K) in shapes.items():
        methods = methods_for(N, K, gen)
        results = {M: time_case(methods, K, M, rounds, args.budget, gen) for M in rows}
        print(f"\n{label} {N}x{K}")
        print(f"{'method':>24} {'kind':>13} " + " ".join(f"{f'M={M}':>14}" for M in rows))
        for name, m in methods.items():
            cells = []
            for M in rows:
                seconds = results[M].get(name)
                cell = "-" if seconds is None else f"{seconds * 1e6:.1f}"
                if seconds is not None and M == 1:
                    cell += f" ({m.size / seconds / 1e9:.0f})"
                cells.append(f"{cell:>14}")
            print(f"{name:>24} {m.kind:>13} " + " ".join(cells), flush=True)
        for M in rows:
            for line in verdicts(methods, results[M]):
                summary.append(f"{label + f' {N}x{K}':>20} M={M:<4} {line}")
        del methods
    print(f"\n{UNTIMED}: not timed by the selector here (no native bf16), left out of the verdicts")
    print("fastest hand-written vs fastest library candidate (library = bf16 activations unless marked fp32-act):")
    print("\n".join(summary))
    if not (args.quick or args.no_select):
        selection(shapes)


if __name__ == "__main__":
    main()
