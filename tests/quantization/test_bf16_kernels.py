"""The quant-cpu plugin's bfloat16 kernels on planar and p16 weights (``qlinear_bf16``,
``qlinear_p16_bf16``, the ``bf16`` gated MLP; the ``cpu_bf16`` and ``cpu_p16_bf16`` matmul kernels):
against torch's bfloat16 product with the dequantized weights rounded to bfloat16, for every bits /
mins / scale dtype / group the layouts take, row counts that end in part of a tile or of a 64-row
block, 1 to 300 rows of ``x``; their rounding of every weight bit for bit (``x`` the identity); the
brgemm path (AMX) and the tiles path (oneDNN limited to AVX512-BF16, and the other instruction-set
builds) alike; bad input refused by name; fake implementations for compilers; their place among the
timed kernels of a bfloat16 engine (the batch rows only)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from modelrunner import native, native_build
from modelrunner.quantization.matmul import QuantizedWeight, WeightFormat

from planar_weights import planar_weights

quant = pytest.importorskip("modelrunner_quant_cpu")
if not quant.available():
    pytest.skip("the quant-cpu kernels do not build here", allow_module_level=True)

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # planar_weights, for a subprocess
K = 384  # groups of 16, 32, 96 and 384 divide it
GROUPS = (16, 32, 96, K)
OUTPUTS = (37, 100)  # 37: part of a 16-row tile; 100: a 64-row block, then part of one
ROWS = (1, 5, 33, 300)


def weights(N: int, group: int, bits: int, mins: bool, scale_dtype: torch.dtype, seed: int = 0):
    """:func:`planar_weights` of ``N`` rows of ``K``."""
    return planar_weights(N, K, group, bits, mins, scale_dtype, seed)


def assert_bf16(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """``y`` against ``F.linear`` of ``x`` and ``w`` rounded to bfloat16: both sum exact products in
    float32, in other orders, and round to bfloat16 — a unit in bfloat16's last place, 2^-8 of an
    output, plus float32 rounding apart, within the 1e-2 of the largest output allowed here. A wrong
    weight, row or scale is off by the order of the output itself."""
    ref = F.linear(x.bfloat16(), w.bfloat16()).float()
    assert y.shape == ref.shape, what
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def check_formats(bits_list=(4, 8), groups=GROUPS, rows=ROWS) -> None:
    """Both operators over the grid, in the build (and on the path) this process runs."""
    gen = torch.Generator().manual_seed(1)
    eye = torch.eye(K, dtype=torch.bfloat16)
    for bits in bits_list:
        for mins in (False, True):
            for scale_dtype in (torch.float16, torch.float32):
                for group in groups:
                    for N in OUTPUTS:
                        storage = weights(N, group, bits, mins, scale_dtype, seed=N + group)
                        w = quant.dequantize(*storage, group, bits)
                        p16 = quant.pack_p16(*storage, group, bits)
                        name = f"int{bits} {'mins' if mins else 'sym'} {scale_dtype} g{group} N={N}"
                        for M in rows:
                            x = torch.randn(M, K, generator=gen).bfloat16()
                            y = quant.qlinear_bf16(x, *storage, group, bits)
                            assert y.dtype == torch.bfloat16
                            assert_bf16(y, x, w, f"planar {name} M={M}")
                            y = quant.qlinear_p16_bf16(x, *p16, N, group, bits, out_dtype=torch.float32)
                            assert y.dtype == torch.float32
                            assert_bf16(y, x, w, f"p16 {name} M={M}")
                        # Each weight rounded as torch rounds it, bit for bit (a zero's sign aside).
                        assert torch.equal(quant.qlinear_bf16(eye, *storage, group, bits).T, w.bfloat16()), name
                        assert torch.equal(quant.qlinear_p16_bf16(eye, *p16, N, group, bits).T, w.bfloat16()), name


@pytest.mark.parametrize("bits", [4, 8])
def test_every_format_against_torch(bits):
    check_formats((bits,))


def _run(script: str, env: dict[str, str]) -> str:
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


_CHECK = (f"import runpy, sys\nsys.path.insert(0, {TESTS!r})\nns = runpy.run_path({__file__!r})\n"
          "ns['check_formats'](groups=(16, 96), rows=(1, 33, 300))\n"
          "print('SIMD', ns['quant'].simd())\n")


def test_the_tiles_path_of_cpus_without_amx():
    # oneDNN limited to AVX512-BF16: brgemm is not offered (could_pack), tiles go through at::mm.
    if not (quant.simd().startswith("avx512") and "amx_bf16" in native.cpu_flags()):
        pytest.skip("the brgemm path is the one that runs here only on AMX CPUs")
    assert "SIMD avx512" in _run(_CHECK, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})


@pytest.mark.parametrize("variant,simd", [("avx512", "avx512"), ("avx2", "avx2"), ("generic", "scalar")])
def test_the_other_instruction_set_builds(variant, simd):
    if not native.runnable(next(v for v in native_build.VARIANTS if v.name == variant)):
        pytest.skip(f"this CPU cannot run the {variant} build")
    if platform.machine() not in ("x86_64", "AMD64") and simd != "scalar":
        pytest.skip("x86-64 code paths")
    assert f"SIMD {simd}" in _run(_CHECK, {native.VARIANT_ENV: variant})


def test_leading_dimensions_empty_inputs_and_inference_mode():
    storage = weights(37, 32, 4, True, torch.float16)
    w = quant.dequantize(*storage, 32, 4)
    x = torch.randn(2, 3, K).bfloat16()
    assert_bf16(quant.qlinear_bf16(x, *storage, 32, 4).reshape(6, 37), x.reshape(6, K), w, "[2, 3, K]")
    p16 = quant.pack_p16(*storage, 32, 4)
    for op, args in ((quant.qlinear_bf16, (*storage, 32, 4)), (quant.qlinear_p16_bf16, (*p16, 37, 32, 4))):
        assert op(torch.zeros(0, K, dtype=torch.bfloat16), *args).shape == (0, 37)
        with torch.inference_mode():
            for rows in (1, 100):
                x = torch.randn(rows, K).bfloat16()
                assert_bf16(op(x, *args), x, w, f"{op.__name__} inference mode, {rows} rows")


@pytest.mark.parametrize("change,message", [
    (lambda x, o: (x.float(), o), "x must be bfloat16, got Float"),
    (lambda x, o: (x[:, :64].contiguous(), o), r"x has 64 features \(x.size\(1\)\) but the weight has K = 384"),
    (lambda x, o: (x.t().contiguous().t(), o), "x must be contiguous"),
    (lambda x, o: (x, torch.float16), "out_dtype must be bfloat16 or float32, got Half"),
])
def test_bad_input_is_refused_by_name(change, message):
    storage = weights(16, 32, 4, True, torch.float16)
    p16 = quant.pack_p16(*storage, 32, 4)
    x, out_dtype = change(torch.randn(4, K).bfloat16(), None)
    with pytest.raises(ValueError, match=message):
        quant.qlinear_bf16(x, *storage, 32, 4, out_dtype=out_dtype)
    with pytest.raises(ValueError, match=message):
        quant.qlinear_p16_bf16(x, *p16, 16, 32, 4, out_dtype=out_dtype)


def test_the_fake_implementations_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    storage = weights(37, 32, 4, True, torch.float16)
    p16 = quant.pack_p16(*storage, 32, 4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, K, dtype=torch.bfloat16)
        y = quant.qlinear_bf16(x, *storage, 32, 4)
        assert y.shape == (3, 37) and y.dtype == torch.bfloat16
        y = quant.qlinear_p16_bf16(x, *p16, 37, 32, 4, out_dtype=torch.float32)
        assert y.shape == (3, 37) and y.dtype == torch.float32


def test_compiles_fullgraph_and_matches_eager():
    storage = weights(100, 32, 4, True, torch.float16)
    p16 = quant.pack_p16(*storage, 32, 4)
    kernel = quant.matmul.CPUP16BF16()
    weight = QuantizedWeight(*p16, WeightFormat(4, 32, True), 100, K, "p16")

    def layer(x):
        return kernel.run(weight, x).relu() + quant.qlinear_bf16(x.bfloat16(), *storage, 32, 4).float()

    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend="aot_eager")
    x = torch.randn(40, K)
    torch.testing.assert_close(compiled(x), layer(x))


def _kernel_weight(cls, bits: int, N: int, K_: int, seed: int):
    fmt = WeightFormat(bits, 32, bits == 4)
    storage = planar_weights(N, K_, 32, bits, bits == 4, torch.float16, seed)
    planar = QuantizedWeight(*storage, fmt, N, K_)
    weight = planar if cls.layout == "planar" else QuantizedWeight(*cls.pack(planar), fmt, N, K_, cls.layout)
    return weight, quant.dequantize(*storage, 32, bits)


@pytest.mark.parametrize("cls", ["CPUBF16", "CPUP16BF16"])
def test_the_matmul_kernels(cls):
    from modelrunner.api import native_bf16

    kernel = getattr(quant.matmul, cls)
    assert kernel in quant.MATMUL_KERNELS and not kernel.exact and kernel.rounds_weights
    assert kernel.activation_kind() == "bf16" and kernel.timed == native_bf16()
    assert kernel.supports(WeightFormat(8, 16, False, scale_dtype="float32"), "cpu")
    assert not kernel.supports(WeightFormat(4, 32, True), "meta")
    for bits in (4, 8):
        weight, w = _kernel_weight(kernel, bits, 37, K, seed=bits)
        bound = kernel().bind(weight)
        for M in (1, 40):
            x = torch.randn(M, K)
            for how, y in (("run", kernel().run(weight, x)), ("bind", bound(x))):
                assert y.dtype == torch.float32, how
                assert_bf16(y, x, w, f"{cls} int{bits} {how} M={M}")
            # A bfloat16 engine's activations as they are (input_dtypes): the same sums, rounded once.
            xb = x.bfloat16()
            want = bound(xb.float()).bfloat16()
            for how, y in (("run", kernel().run(weight, xb)), ("bind", bound(xb))):
                assert y.dtype == torch.bfloat16 and torch.equal(y, want), f"{cls} int{bits} {how} M={M} bf16"
    assert torch.bfloat16 in kernel.input_dtypes


def test_the_bf16_gated_mlp_is_its_three_calls():
    kernel = quant.matmul.CPUP16BF16()
    hidden, inner = K, 160
    gate_up, _ = _kernel_weight(quant.matmul.CPUP16BF16, 4, 2 * inner, hidden, seed=1)
    down, _ = _kernel_weight(quant.matmul.CPUP16BF16, 4, hidden, inner, seed=2)
    fused = kernel.bind_gated_mlp(gate_up, down)
    for M in (1, 17, 70):
        x = torch.randn(M, hidden)
        h = kernel.run(gate_up, x)
        want = kernel.run(down, (F.silu(h[:, :inner]) * h[:, inner:]).contiguous())
        torch.testing.assert_close(fused(x), want, rtol=0, atol=0)


def test_in_a_bf16_engine_cpu_p16_bf16_joins_the_exact_p16_kernels_for_the_batch_rows(monkeypatch):
    from torch import nn

    from modelrunner.plugins import Plugins
    from modelrunner_quantization.kernels import KernelSelector
    from modelrunner_quantization.planar import PlanarScheme

    monkeypatch.setattr(quant.matmul.CPUP16BF16, "timed", True)  # as where the CPU computes bf16 natively
    monkeypatch.setattr(quant.matmul.CPUBF16, "timed", True)
    selector = KernelSelector("float", plugins=Plugins())
    scheme = PlanarScheme(4, 32, has_mins=True, kernels=selector)
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.empty(64, K, device="meta"), requires_grad=False)
    scheme.create_storage(layer, 64, K)
    for name, tensor in zip(("weight", "weight_scales", "weight_mins"), weights(64, 32, 4, True, torch.float16)):
        setattr(layer, name, nn.Parameter(tensor, requires_grad=False))  # on the CPU, where the kernels claim it
    layer.weight.logical_shape = (64, K)
    layer.quant_scheme = scheme
    assert not {"cpu_bf16", "cpu_p16_bf16"} & set(selector._unfiltered(scheme, layer))  # float32 engine: exact only
    selector.dtype = torch.bfloat16
    allowed = selector._unfiltered(scheme, layer)
    assert {"cpu_bf16", "cpu_p16_bf16"} <= set(allowed)
    assert selector.family_of("cpu_bf16") == selector.family_of("cpu_exact") == "float-planar"
    if quant.p16_exact_supported(4):
        assert selector.family_of("cpu_p16_bf16") == selector.family_of("cpu_p16_exact") == "float-p16"
    for name in ("cpu_bf16", "cpu_p16_bf16"):
        assert selector.in_bucket(name, "batch") and not selector.in_bucket(name, "decode")
