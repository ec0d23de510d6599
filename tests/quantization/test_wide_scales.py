"""The quant-cpu plugin's kernels on the formats real GGUF K-quant files bring: float32 scales and mins
(a super-block's float16 scale times a sub-block's integer scale) and groups of 16 (Q6_K, Q3_K, Q2_K),
next to float16 scales and groups of 32 and 64. Every operator, against the dequantized weight
(exact kernels: the float matmul up to summation order; ``dequantize``: bit for bit; q8 kernels:
llama.cpp's arithmetic), in the build this CPU loads and in each other instruction-set build it runs."""

from __future__ import annotations

import itertools
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from modelrunner import native, native_build
from modelrunner.quantization.matmul import QuantizedWeight, WeightFormat

from planar_weights import planar_weights as weights

quant = pytest.importorskip("modelrunner_quant_cpu")
if not quant.available():
    pytest.skip("the quant-cpu kernels do not build here", allow_module_level=True)

N, K = 37, 128  # rows: not a multiple of 16 (p16 pads them); K: two groups of 64, eight of 16
ROWS = (1, 3, 17, 300)  # one decode row, register tiles, a tile remainder, the dequantized-tile GEMMs
FORMATS = list(itertools.product(("float16", "float32"), (16, 32, 64), (4, 8), (False, True)))


def _assert_exact(y: torch.Tensor, x: torch.Tensor, w_ref: torch.Tensor, what: str) -> None:
    ref = x.double() @ w_ref.double().T
    assert y.dtype == torch.float32 and y.shape == ref.shape, what
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def _assert_q8(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def check_format(scale_dtype: str, group: int, bits: int, mins: bool) -> None:
    """Every operator of the loaded build on one format, at every row count of :data:`ROWS`."""
    name = f"{quant.simd()} {scale_dtype} g{group} int{bits} {'mins' if mins else 'sym'}"
    qweight, scales, lows = weights(N, K, group, bits, mins, scale_dtype)
    w_ref = quant.reference_dequantize(qweight, scales, lows, group, bits)
    assert torch.equal(quant.dequantize(qweight, scales, lows, group, bits), w_ref), name
    int8_groups = group % 32 == 0  # the kernels with int8 activations scale whole 32-value blocks
    p16 = quant.pack_p16(qweight, scales, lows, group, bits)
    assert p16[1].dtype == scales.dtype and (p16[2] is None or p16[2].dtype == scales.dtype), name
    back = quant.unpack_p16(*p16, N, bits)
    assert torch.equal(back[0], qweight) and torch.equal(back[1], scales), name
    assert back[2] is None if lows is None else torch.equal(back[2], lows)
    binders = {"exact": quant.bind_qlinear_p16_exact, "split": quant.bind_qlinear_p16_split,
               "q8": quant.bind_qlinear_p16}
    kinds = [kind for kind, supported in (("exact", quant.p16_exact_supported(bits)),
                                          ("split", int8_groups and quant.p16_split_supported(bits)),
                                          ("q8", int8_groups and quant.p16_supported(bits))) if supported]
    p16_ops = {kind: binders[kind](*p16, N, group, bits) for kind in kinds}
    gen = torch.Generator().manual_seed(1)
    for M in ROWS:
        x = torch.randn(M, K, generator=gen)
        for gemm_rows in (1, 1 << 30):  # dequantized tiles through MKL; registers
            _assert_exact(quant.qlinear(x, qweight, scales, lows, group, bits, gemm_rows=gemm_rows), x, w_ref,
                          f"{name} qlinear gemm_rows={gemm_rows} M={M}")
        for kind in ("exact", "split"):
            if kind in p16_ops:
                _assert_exact(p16_ops[kind](x), x, w_ref, f"{name} p16 {kind} M={M}")
        if not int8_groups:
            continue
        q8_ref = quant.reference_qlinear_q8(x, qweight, scales, lows, group, bits)
        for packed_rows in (1, 1 << 30):  # repacked tiles; per-row kernels
            _assert_q8(quant.qlinear(x, qweight, scales, lows, group, bits, mode="q8", packed_rows=packed_rows), q8_ref,
                       f"{name} q8 packed_rows={packed_rows} M={M}")
        if "q8" in p16_ops:
            _assert_q8(p16_ops["q8"](x), q8_ref, f"{name} p16 q8 M={M}")
    # The fused gated MLP (K -> 2 x 64 -> N): the same numbers as its kernel's three calls.
    inter = 64
    gate_up = weights(2 * inter, K, group, bits, mins, scale_dtype, seed=2)
    down = weights(N, inter, group, bits, mins, scale_dtype, seed=3)
    gu_part = (*quant.pack_p16(*gate_up, group, bits), 2 * inter, group, bits)
    down_part = (*quant.pack_p16(*down, group, bits), N, group, bits)
    for kind in kinds:
        fused = quant.bind_gated_mlp_p16(gu_part, down_part, kernel=kind)
        gu, dn = binders[kind](*gu_part), binders[kind](*down_part)
        for M in (1, 17):
            x = torch.randn(M, K, generator=gen)
            h = gu(x)
            torch.testing.assert_close(fused(x), dn((F.silu(h[:, :inter]) * h[:, inter:]).contiguous()),
                                       msg=lambda m: f"{name} gated {kind} M={M}: {m}")


@pytest.mark.parametrize("scale_dtype,group,bits,mins", FORMATS)
def test_every_operator_on_the_format(scale_dtype, group, bits, mins):
    check_format(scale_dtype, group, bits, mins)


@pytest.mark.parametrize("variant,simd", [("avx512", "avx512"), ("avx2", "avx2"), ("generic", "scalar")])
def test_every_operator_in_the_other_instruction_set_builds(variant, simd):
    if not native.runnable(next(v for v in native_build.VARIANTS if v.name == variant)):
        pytest.skip(f"this CPU cannot run the {variant} build")
    if platform.machine() not in ("x86_64", "AMD64") and simd != "scalar":
        pytest.skip("x86-64 code paths")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # planar_weights
    script = (f"import runpy, sys\nsys.path.insert(0, {tests!r})\nns = runpy.run_path({__file__!r})\n"
              f"for f in ns['FORMATS']:\n    ns['check_format'](*f)\nprint('SIMD', ns['quant'].simd())\n")
    env = {**os.environ, native.VARIANT_ENV: variant}
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"SIMD {simd}" in result.stdout


def test_the_int8_activation_ops_refuse_groups_of_16_by_name():
    qweight, scales, lows = weights(N, K, 16, 4, True, "float32")
    with pytest.raises(ValueError, match="the q8 kernel takes groups of a multiple of 32, got group_size 16"):
        quant.qlinear(torch.randn(1, K), qweight, scales, lows, 16, 4, mode="q8")
    p16 = quant.pack_p16(qweight, scales, lows, 16, 4)
    for supported, bind, kernel in ((quant.p16_supported, quant.bind_qlinear_p16, "p16"),
                                    (quant.p16_split_supported, quant.bind_qlinear_p16_split, "split p16")):
        if supported(4):
            with pytest.raises(ValueError, match=f"the {kernel} kernel takes groups of a multiple of 32"):
                bind(*p16, N, 16, 4)(torch.randn(1, K))


@pytest.mark.parametrize("scales_dtype,mins_dtype,message", [
    (torch.float64, None, r"scales must be float16 or float32, got Double"),
    (torch.float32, torch.float16, r"mins must be float32 like scales, got Half"),
    (torch.float16, torch.float32, r"mins must be float16 like scales, got Float"),
])
def test_scale_dtypes_are_checked_by_name(scales_dtype, mins_dtype, message):
    qweight, scales, lows = weights(N, K, 32, 4, True, "float32")
    scales, lows = scales.to(scales_dtype), lows.to(mins_dtype or scales_dtype)
    with pytest.raises(ValueError, match=message):
        quant.dequantize(qweight, scales, lows, 32, 4)
    with pytest.raises(ValueError, match=r"group_size must be 16 or a positive multiple of 32 that divides K = 128, "
                                         r"got 48"):
        quant.dequantize(qweight, scales.float(), None, 48, 4)


def test_the_kernels_claim_what_they_run_and_run_it_through_the_matmul_api():
    kernels = {cls.name: cls for cls in quant.MATMUL_KERNELS}
    q6_k = WeightFormat(8, 16, False, scale_dtype="float32")  # Q6_K as stored
    q4_k = WeightFormat(4, 32, True, scale_dtype="float32")  # Q4_K as stored
    assert kernels["cpu_exact"].supports(q6_k, "cpu") and kernels["cpu_exact"].supports(q4_k, "cpu")
    assert kernels["cpu_p16_exact"].supports(q6_k, "cpu") == quant.p16_exact_supported(8)
    assert not kernels["cpu_q8"].supports(q6_k, "cpu") and kernels["cpu_q8"].supports(q4_k, "cpu")
    assert not kernels["cpu_p16"].supports(q6_k, "cpu") and not kernels["cpu_p16_split"].supports(q6_k, "cpu")
    assert not any(cls.supports(WeightFormat(4, 48, True), "cpu") for cls in quant.MATMUL_KERNELS)
    x = torch.randn(3, K)
    for fmt in (q6_k, q4_k, WeightFormat(4, 16, True, scale_dtype="float32")):
        storage = weights(N, K, fmt.group_size, fmt.bits, fmt.has_mins, fmt.scale_dtype)
        w_ref = quant.reference_dequantize(*storage, fmt.group_size, fmt.bits)
        for cls in quant.MATMUL_KERNELS:
            if not cls.supports(fmt, "cpu"):
                continue
            planar = QuantizedWeight(*storage, fmt, N, K)
            weight = planar._replace(layout=cls.layout) if cls.layout == "planar" else QuantizedWeight(
                *cls.pack(planar), fmt, N, K, cls.layout)
            y = cls().bind(weight)(x)
            if cls.exact:
                _assert_exact(y, x, w_ref, f"{cls.name} {fmt}")
            elif cls.activation_kind() == "bf16":  # x and the weights rounded to bfloat16, float32 sums
                ref = F.linear(x.bfloat16(), w_ref.bfloat16()).double()
                torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item(),
                                           msg=lambda m, cls=cls, fmt=fmt: f"{cls.name} {fmt}: {m}")
            else:
                _assert_q8(y, quant.reference_qlinear_q8(x, *storage, fmt.group_size, fmt.bits), f"{cls.name} {fmt}")
            assert all(torch.equal(a, b) for a, b in zip(cls.unpack(weight), storage) if b is not None)
