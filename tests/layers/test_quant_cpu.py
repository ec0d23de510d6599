"""The quant-cpu plugin's kernels: dequantize against the pure-torch reference (bit for bit), qlinear
in both modes against float64 references (bits 4 and 8, with and without mins, every group size,
row counts around every tile size, odd N), every kernel of each mode forced for every M, the other
instruction-set builds, errors naming the bad value, torch.compile, and the plugin listing."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from modelrunner import native, native_build

quant = pytest.importorskip("modelrunner_quant_cpu")
if not quant.available():
    pytest.skip("the quant-cpu kernels do not build here", allow_module_level=True)

pack_nibbles = quant.reference.pack_nibbles
reference_dequantize = quant.reference_dequantize
reference_qlinear_q8 = quant.reference_qlinear_q8

K = 384  # a multiple of 32, 64 and 128


def weights(N: int, K: int, group: int, bits: int, mins: bool, seed: int = 0):
    """Random integers, scales of both signs (some negative, as in real checkpoints' rounding) and,
    with ``mins``, GGUF-like mins around ``-8 * scale``."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        qweight = pack_nibbles(torch.randint(0, 16, (N, K), generator=gen))
    else:
        qweight = torch.randint(-128, 128, (N, K), generator=gen).to(torch.int8)
    sign = torch.where(torch.rand(N, K // group, generator=gen) < 0.1, -1.0, 1.0)
    scales = ((torch.rand(N, K // group, generator=gen) + 0.5) * 0.01 * sign).half()
    lows = (-(8 + torch.rand(N, K // group, generator=gen)) * scales.float()).half() if mins else None
    return qweight, scales, lows


def test_nibble_order_is_ggml():
    q = torch.arange(32).remainder(16).view(1, 32)
    packed = pack_nibbles(q)
    assert packed.shape == (1, 16)
    assert packed[0, 3].item() == (3 | (3 << 4))  # element 3 low, element 19 (= 3 mod 16) high
    q = torch.zeros(1, 32, dtype=torch.long)
    q[0, 20] = 9
    assert pack_nibbles(q)[0, 4].item() == 9 << 4
    scales = torch.ones(1, 1, dtype=torch.float16)
    assert quant.dequantize(pack_nibbles(q), scales, None, 32, 4)[0].tolist() == q[0].float().tolist()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128, K])
def test_dequantize_equals_the_reference_exactly(bits, mins, group):
    qweight, scales, lows = weights(37, K, group, bits, mins)
    out = quant.dequantize(qweight, scales, lows, group, bits)
    assert out.dtype == torch.float32 and out.shape == (37, K)
    assert torch.equal(out, reference_dequantize(qweight, scales, lows, group, bits))


def _assert_exact(y, x, w_ref):
    ref = x.double() @ w_ref.double().T
    assert y.dtype == torch.float32 and y.shape == ref.shape
    if ref.numel():
        torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128, K])
@pytest.mark.parametrize("N", [36, 1000])
def test_qlinear_matches_the_references(bits, mins, group, N):
    qweight, scales, lows = weights(N, K, group, bits, mins)
    w_ref = reference_dequantize(qweight, scales, lows, group, bits)
    p16 = (quant.pack_p16(qweight, scales, lows, group, bits)
           if quant.p16_supported(bits) or quant.p16_exact_supported(bits) else None)
    gen = torch.Generator().manual_seed(1)
    for M in (0, 1, 3, 8, 17, 64, 300):
        x = torch.randn(M, K, generator=gen)
        # Exact: the default crossover, and each path forced (registers for every M, MKL for every M).
        for gemm_rows in (None, 1, 1 << 30):
            _assert_exact(quant.qlinear(x, qweight, scales, lows, group, bits, gemm_rows=gemm_rows), x, w_ref)
        if p16 is not None and quant.p16_exact_supported(bits):  # exact, on the p16 layout
            _assert_exact(quant.bind_qlinear_p16_exact(*p16, N, group, bits)(x), x, w_ref)
        if p16 is not None and quant.p16_split_supported(bits):  # exact, through three int8 digits of x
            _assert_exact(quant.bind_qlinear_p16_split(*p16, N, group, bits)(x), x, w_ref)
        # q8: the default crossover, the per-row kernel for every M, the repacked-tile kernel for every M.
        outs = [quant.qlinear(x, qweight, scales, lows, group, bits, mode="q8", packed_rows=packed_rows)
                for packed_rows in (None, 1 << 30, 1)]
        if quant.p16_supported(bits):  # the same arithmetic on the weight regrouped in tiles of 16 rows
            outs.append(quant.bind_qlinear_p16(*p16, N, group, bits)(x))
        assert all(y.dtype == torch.float32 and y.shape == (M, N) for y in outs)
        if M == 0:
            continue
        # q8 is llama.cpp's arithmetic exactly (same int8 activations and scales; float32 sums) ...
        q8_ref = reference_qlinear_q8(x, qweight, scales, lows, group, bits)
        for y in outs:
            torch.testing.assert_close(y.double(), q8_ref, rtol=1e-5, atol=1e-5 * q8_ref.abs().max().item())
        y = outs[0]
        # ... and close to the float product: rounding x to 127 steps of its block's amax errs by at
        # most amax/254 per element (rms ~0.5% of a Gaussian block's rms), carried through the
        # unsigned integers (0..15, mean 7.5): measured up to 1.4% of the output's norm here.
        ref = x.double() @ w_ref.double().T
        assert ((y.double() - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("N,K,group", [(37, 576, 96), (9, 160, 32), (9, 160, 160)])
def test_odd_block_counts(bits, N, K, group):
    # Groups of 3 blocks, and rows of 5 blocks: the kernels that take blocks two at a time step aside
    # or finish with a single block.
    qweight, scales, lows = weights(N, K, group, bits, True)
    w_ref = reference_dequantize(qweight, scales, lows, group, bits)
    for M in (1, 3, 9, 50):  # 50: the AVX2 exact p16 kernel's dequantized tiles for MKL
        x = torch.randn(M, K)
        for gemm_rows in (1, 1 << 30):
            _assert_exact(quant.qlinear(x, qweight, scales, lows, group, bits, gemm_rows=gemm_rows), x, w_ref)
        p16 = quant.pack_p16(qweight, scales, lows, group, bits)
        for supported, bind in ((quant.p16_exact_supported, quant.bind_qlinear_p16_exact),
                                (quant.p16_split_supported, quant.bind_qlinear_p16_split)):
            if supported(bits):
                _assert_exact(bind(*p16, N, group, bits)(x), x, w_ref)
        q8_ref = reference_qlinear_q8(x, qweight, scales, lows, group, bits)
        for packed_rows in (1, 1 << 30):
            y = quant.qlinear(x, qweight, scales, lows, group, bits, mode="q8", packed_rows=packed_rows)
            torch.testing.assert_close(y.double(), q8_ref, rtol=1e-5, atol=1e-5 * q8_ref.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("N", [16, 37])
def test_p16_layout_round_trips(bits, mins, N):
    if not quant.p16_supported(bits):
        pytest.skip(f"no p16 kernel for {bits}-bit weights in this build ({quant.simd()})")
    qweight, scales, lows = weights(N, K, 64, bits, mins)
    data, packed_scales, packed_mins = quant.pack_p16(qweight, scales, lows, 64, bits)
    # The same bytes regrouped (rows padded to 16): the planar shapes, padded.
    assert data.shape == (48 if N == 37 else 16, qweight.shape[1]) and packed_scales.shape == (data.shape[0], K // 64)
    assert (packed_mins is None) == (lows is None)
    back = quant.unpack_p16(data, packed_scales, packed_mins, N, bits)
    assert torch.equal(back[0], qweight) and torch.equal(back[1], scales)
    assert back[2] is None if lows is None else torch.equal(back[2], lows)
    ids = torch.tensor([N - 1, 0, 5])
    rows = quant.unpack_p16(data, packed_scales, packed_mins, N, bits, ids)
    assert torch.equal(rows[0], qweight[ids]) and torch.equal(rows[1], scales[ids])
    # Padding rows multiply as zero weights: only the N real outputs come back.
    x = torch.randn(2, K)
    assert quant.bind_qlinear_p16(data, packed_scales, packed_mins, N, 64, bits)(x).shape == (2, N)
    if quant.p16_exact_supported(bits):
        assert quant.bind_qlinear_p16_exact(data, packed_scales, packed_mins, N, 64, bits)(x).shape == (2, N)
    if quant.p16_split_supported(bits):
        assert quant.bind_qlinear_p16_split(data, packed_scales, packed_mins, N, 64, bits)(x).shape == (2, N)


def test_p16_bad_input_is_refused_by_name():
    if not quant.p16_supported(4):
        pytest.skip(f"no p16 kernel in this build ({quant.simd()})")
    qweight, scales, lows = weights(37, K, 32, 4, True)
    data, packed_scales, packed_mins = quant.pack_p16(qweight, scales, lows, 32, 4)
    binders = [quant.bind_qlinear_p16] + ([quant.bind_qlinear_p16_exact] if quant.p16_exact_supported(4) else []) + (
        [quant.bind_qlinear_p16_split] if quant.p16_split_supported(4) else [])
    for bind in binders:
        with pytest.raises(ValueError, match=r"rows must be in \(32, 48\] .* got 60"):
            bind(data, packed_scales, packed_mins, 60, 32, 4)(torch.randn(1, K))
        with pytest.raises(ValueError, match="multiple of 16 rows, got 37"):
            bind(qweight, scales, lows, 37, 32, 4)(torch.randn(1, K))
        with pytest.raises(ValueError, match="x has 32 features"):
            bind(data, packed_scales, packed_mins, 37, 32, 4)(torch.randn(1, 32))
    part = (data, packed_scales, packed_mins, 37, 32, 4)
    with pytest.raises(ValueError, match=r"kernel must be one of q8, exact, split, bf16, got 'fast'"):
        quant.bind_gated_mlp_p16(part, part, kernel="fast")


def test_qlinear_takes_leading_dimensions():
    qweight, scales, lows = weights(40, K, 64, 4, True)
    x = torch.randn(2, 3, K)
    for mode in ("exact", "q8"):
        y = quant.qlinear(x, qweight, scales, lows, 64, 4, mode=mode)
        assert y.shape == (2, 3, 40)
        flat = quant.qlinear(x.view(6, K), qweight, scales, lows, 64, 4, mode=mode)
        torch.testing.assert_close(y, flat.view(2, 3, 40))


@pytest.mark.parametrize("mode", ["exact", "q8"])
@pytest.mark.parametrize("rows", [1, 200])  # 200: the tiled path whose threads run at::mm_out
def test_runs_under_inference_mode(mode, rows):
    # The engine runs forwards under torch.inference_mode: worker threads must write its outputs too.
    qweight, scales, lows = weights(300, K, 32, 8, False)
    x = torch.randn(rows, K)
    with torch.inference_mode():
        y = quant.qlinear(x, qweight, scales, lows, 32, 8, mode=mode)
    torch.testing.assert_close(y, quant.qlinear(x, qweight, scales, lows, 32, 8, mode=mode))


def test_extreme_values_stay_exact():
    # Every weight at its most negative integer, activations with one dominant element per block.
    qweight = torch.full((8, 64), -128, dtype=torch.int8)
    scales = torch.full((8, 2), 0.5, dtype=torch.float16)
    x = torch.zeros(3, 64)
    x[:, ::32] = 1e3
    x[:, 1::32] = -1e-3
    y = quant.qlinear(x, qweight, scales, None, 32, 8, mode="q8")
    torch.testing.assert_close(y.double(), reference_qlinear_q8(x, qweight, scales, None, 32, 8))
    _assert_exact(quant.qlinear(x, qweight, scales, None, 32, 8), x, reference_dequantize(qweight, scales, None, 32, 8))
    zeros = torch.zeros(2, 64)  # all-zero blocks: scale 0, no division by zero
    assert quant.qlinear(zeros, qweight, scales, None, 32, 8, mode="q8").abs().max() == 0


def _args(bits=4, N=16, K=64, group=32, mins=True):
    qweight, scales, lows = weights(N, K, group, bits, mins)
    return [torch.randn(3, K), qweight, scales, lows, group, bits]


def _with(index, value):
    def change(args):
        args = list(args)
        args[index] = value(args[index]) if callable(value) else value
        return args
    return change


@pytest.mark.parametrize("change,message", [
    (_with(5, 5), r"bits must be 4 or 8, got 5"),
    (_with(1, lambda q: q.float()), r"qweight must be uint8 for bits=4, got Float"),
    (_with(1, lambda q: q.view(torch.int8)), r"qweight must be uint8 for bits=4, got Char"),
    (_with(5, 8), r"qweight must be int8 for bits=8, got Byte"),
    (_with(1, lambda q: q[:, :20].contiguous()), r"K \(input features\) must be a positive multiple of 32, got K = 40"),
    (_with(1, lambda q: q.view(-1)), r"qweight must be 2-D"),
    (_with(1, lambda q: torch.cat([q, q], 1)[:, ::2]), r"qweight must be contiguous"),
    (_with(4, 48), r"group_size must be 16 or a positive multiple of 32 that divides K = 64, got 48"),
    (_with(4, 128), r"group_size must be 16 or a positive multiple of 32 that divides K = 64, got 128"),
    (_with(2, lambda s: s.double()), r"scales must be float16 or float32, got Double"),
    (_with(2, lambda s: s.float()), r"mins must be float32 like scales, got Half"),
    (_with(2, lambda s: s[:, :1].contiguous()), r"scales must be \[N, K/group_size\] = \[16, 2\], got shape \[16, 1\]"),
    (_with(3, lambda m: m[:15].contiguous()), r"mins must be \[N, K/group_size\] = \[16, 2\], got shape \[15, 2\]"),
    (_with(3, lambda m: m.t().contiguous().t()), r"mins must be contiguous"),
    (_with(0, lambda x: x.double()), r"x must be float32, got Double"),
    (_with(0, lambda x: x[:, :32].contiguous()), r"x has 32 features \(x.size\(1\)\) but the weight has K = 64"),
    (_with(0, lambda x: torch.cat([x, x], 1)[:, ::2]), r"x must be contiguous"),
])
@pytest.mark.parametrize("mode", ["exact", "q8"])
def test_bad_input_is_refused_by_name(change, message, mode):
    args = change(_args())
    with pytest.raises(ValueError, match=message):
        quant.qlinear(*args, mode=mode)


def test_bad_input_to_dequantize_and_bad_mode():
    _, qweight, scales, lows, group, bits = _args()
    with pytest.raises(ValueError, match=r"group_size must be 16 or a positive multiple of 32 that divides K = 64, "
                                         r"got 0"):
        quant.dequantize(qweight, scales, lows, 0, bits)
    with pytest.raises(ValueError, match=r"mode must be 'exact' or 'q8', got 'fast'"):
        quant.qlinear(torch.randn(1, 64), qweight, scales, lows, group, bits, mode="fast")


def test_compiles_fullgraph_and_matches_eager():
    qweight, scales, lows = weights(100, K, 64, 4, True)
    q8, s8, _ = weights(50, K, K, 8, False)

    def layer(x):
        h = quant.qlinear(x, qweight, scales, lows, 64, 4)
        h = torch.nn.functional.silu(h) @ torch.ones(100, K) * 1e-2
        return quant.qlinear(h.contiguous(), q8, s8, None, K, 8, mode="q8") + quant.dequantize(q8, s8, None, K, 8).sum()

    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    for M in (1, 5):
        x = torch.randn(M, K)
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-4, atol=1e-4)


def test_listed_as_a_plugin():
    listing = subprocess.run([sys.executable, "-m", "modelrunner.cli", "plugins", "--json"], capture_output=True,
                             text=True, timeout=120, check=True)
    plugin = {p["name"]: p for p in json.loads(listing.stdout)}["quant-cpu"]
    assert plugin["distribution"] == "modelrunner-quant-cpu"
    assert plugin["error"] is None and plugin["hooks"] == ["register"]
    assert plugin["provides"] == {"matmul_kernels": ["cpu_bf16", "cpu_exact", "cpu_ggml", "cpu_ggml_bf16", "cpu_ggml_q8",
                                                  "cpu_ggml_split", "cpu_p16", "cpu_p16_bf16", "cpu_p16_exact",
                                                  "cpu_p16_split", "cpu_q8"]}


_CHECK_BUILD = textwrap.dedent("""
    import torch
    import modelrunner_quant_cpu as quant
    from modelrunner_quant_cpu.reference import pack_nibbles, reference_dequantize, reference_qlinear_q8
    print("SIMD", quant.simd())
    gen = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        for mins in (False, True):
            for group, K in ((32, 256), (128, 256), (96, 288)):
                N = 37
                low, high = (0, 16) if bits == 4 else (-128, 128)
                q = torch.randint(low, high, (N, K), generator=gen)
                qweight = pack_nibbles(q) if bits == 4 else q.to(torch.int8)
                scales = ((torch.rand(N, K // group, generator=gen) + 0.5) * 0.01).half()
                lows = (-8 * scales.float()).half() if mins else None
                w = reference_dequantize(qweight, scales, lows, group, bits)
                assert torch.equal(quant.dequantize(qweight, scales, lows, group, bits), w)
                for M in (1, 5, 9, 40):
                    x = torch.randn(M, K, generator=gen)
                    ref = x.double() @ w.double().T
                    for gemm_rows in (1, 1 << 30):
                        y = quant.qlinear(x, qweight, scales, lows, group, bits, gemm_rows=gemm_rows).double()
                        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
                    r8 = reference_qlinear_q8(x, qweight, scales, lows, group, bits)
                    for packed_rows in (1, 1 << 30):
                        y = quant.qlinear(x, qweight, scales, lows, group, bits, mode="q8", packed_rows=packed_rows)
                        torch.testing.assert_close(y.double(), r8, rtol=1e-5, atol=1e-5 * r8.abs().max().item())
                    p16 = quant.pack_p16(qweight, scales, lows, group, bits)
                    if quant.p16_supported(bits):
                        y = quant.bind_qlinear_p16(*p16, N, group, bits)(x)
                        torch.testing.assert_close(y.double(), r8, rtol=1e-5, atol=1e-5 * r8.abs().max().item())
                    for supported, bind in ((quant.p16_exact_supported, quant.bind_qlinear_p16_exact),
                                            (quant.p16_split_supported, quant.bind_qlinear_p16_split)):
                        if supported(bits):
                            y = bind(*p16, N, group, bits)(x).double()
                            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    print("OK", "p16" if quant.p16_supported(4) else "no-p16", "p16-exact" if quant.p16_exact_supported(4) else "",
          "p16-split" if quant.p16_split_supported(4) else "")
""")


@pytest.mark.parametrize("variant,simd", [("avx512", "avx512"), ("avx2", "avx2"), ("generic", "scalar")])
def test_other_instruction_sets_are_installed_and_agree(variant, simd):
    # AVX-512 without VNNI (Skylake-X); AVX2 is what Zen 1-3 run; the portable build, CPUs without AVX2.
    if not native.runnable(next(v for v in native_build.VARIANTS if v.name == variant)):
        pytest.skip(f"this CPU cannot run the {variant} build")
    if platform.machine() not in ("x86_64", "AMD64") and simd != "scalar":
        pytest.skip("x86-64 code paths")
    env = {**os.environ, native.VARIANT_ENV: variant}
    result = subprocess.run([sys.executable, "-c", _CHECK_BUILD], check=False, capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"SIMD {simd}" in result.stdout and "OK" in result.stdout
    assert ("no-p16" in result.stdout) == (simd == "scalar")  # p16 needs AVX2
    assert ("p16-exact" in result.stdout) == (simd != "scalar")  # its exact kernel: AVX2 and AVX-512
    assert "p16-split" not in result.stdout  # the split kernel needs VNNI, which none of these builds has


def test_without_its_installed_build_it_is_unavailable_with_the_reason(tmp_path):
    # The package as pip leaves it where the build failed (no compiler): the sources, no libraries.
    shutil.copytree(Path(quant.__file__).parent, tmp_path / "modelrunner_quant_cpu",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    script = textwrap.dedent("""
        import warnings
        import torch
        import modelrunner_quant_cpu as quant
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("AVAILABLE", quant.available())
        print("WARNED", [str(w.message) for w in caught])
        try:
            qweight, scales = torch.zeros(1, 16, dtype=torch.uint8), torch.ones(1, 1).half()
            quant.qlinear(torch.zeros(1, 32), qweight, scales, None, 32, 4)
        except quant.KernelUnavailable as e:
            print("RAISED", e)
    """)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "AVAILABLE False" in result.stdout
    assert "the quant-cpu kernels are unavailable: the quantized-matmul kernels are not built for this CPU" \
        in result.stdout
    assert "RAISED the quantized-matmul kernels are not built" in result.stdout and "pip install -v" in result.stdout
