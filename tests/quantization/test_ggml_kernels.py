"""The quant-cpu plugin's kernels on ggml's blocks as a GGUF file stores them (``ggml_matmul.cpp``):
``ggml_dequantize`` bit for bit against the ``gguf`` package's dequantizer, ``ggml_qlinear`` against
the float product with those weights (exact kernels: up to summation order) at row counts around
every register tile and on both sides of the GEMM threshold, ``ggml_linear_bf16`` against torch's
bfloat16 product with those weights rounded to bfloat16 (and its rounding bit for bit),
``ggml_qlinear_int`` (VNNI integer dot products, exact and int8) against the same float product, in the
build this CPU loads and in each other instruction-set build it runs; bad input refused by name; the
``cpu_ggml``, ``cpu_ggml_split``, ``cpu_ggml_q8`` and ``cpu_ggml_bf16`` matmul kernels."""

from __future__ import annotations

import itertools
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from modelrunner import native, native_build
from modelrunner_kit.conformance.gguf import random_blocks
from modelrunner.quantization.matmul import QuantizedWeight, WeightFormat

gguf = pytest.importorskip("gguf")
quant = pytest.importorskip("modelrunner_quant_cpu")
if not quant.ggml_available():
    pytest.skip("the quant-cpu ggml-block kernels do not build here", allow_module_level=True)

Q5_0, Q8_0, Q4_K, Q5_K, Q6_K = 6, 8, 12, 13, 14
TYPES = [t for t in (Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) if quant.ggml_supported(t)]
ROWS = (1, 2, 3, 5, 8, 17, 64, 300)  # one decode row, register tiles of 1-4 and their remainders, GEMMs
OUTPUTS = (1, 15, 33, 300)
FEATURES = (256, 512, 2304)


def reference(blocks, ggml_type: int) -> torch.Tensor:
    """The ``gguf`` package's dequantization (ggml's own arithmetic, in numpy)."""
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(ggml_type)).copy())


def assert_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    ref = F.linear(x.double(), w.double())
    assert y.dtype == torch.float32 and y.shape == ref.shape, what
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def check_type(ggml_type: int) -> None:
    """Every shape of the grid for one type, in the loaded build."""
    gen = torch.Generator().manual_seed(ggml_type)
    for N, K in itertools.product(OUTPUTS, FEATURES):
        name = f"{quant.GGML_TYPES[ggml_type][0]} N={N} K={K}"
        blocks = random_blocks(ggml_type, N, K, seed=N + K)
        w = reference(blocks, ggml_type)
        data = torch.from_numpy(blocks)
        assert torch.equal(quant.ggml_dequantize(data, ggml_type), w), f"{name}: ggml_dequantize"
        for M in ROWS:
            x = torch.randn(M, K, generator=gen)
            assert_exact(quant.ggml_qlinear(x, data, ggml_type), x, w, f"{name} M={M}")
        x = torch.randn(17, K, generator=gen)  # each path on the other side of the threshold
        assert_exact(quant.ggml_qlinear(x, data, ggml_type, gemm_rows=0), x, w, f"{name} M=17 dequantized tiles")
        x = torch.randn(64, K, generator=gen)
        assert_exact(quant.ggml_qlinear(x, data, ggml_type, gemm_rows=1 << 30), x, w, f"{name} M=64 registers")


BF16_ROWS = (1, 3, 64, 300)  # the register kernel (up to GGML_BF16_GEMM_ROWS), then bfloat16 tiles
BF16_OUTPUTS = (1, 33, 300)


def assert_bf16(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    """``y`` against torch's bfloat16 product of ``x`` and the weights rounded to bfloat16. Both sum
    exact products in float32 and round the sum to bfloat16, in other orders (another blocking, another
    library): they may differ by a unit in the last place of bfloat16, 2^-8 of an output, plus float32
    rounding — so up to 2^-8 of the largest output, within the 1e-2 of it allowed here. A wrong
    weight, row or scale is off by the order of the output itself."""
    ref = F.linear(x, w.bfloat16()).float()
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape, what
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item(),
                               msg=lambda m: f"{what}: {m}")


def check_bf16_type(ggml_type: int) -> None:
    """``ggml_linear_bf16``: every shape of its grid for one type, and its rounding of every weight
    exactly as torch's (``x`` the identity: ``y`` is the rounded weight), in the loaded build."""
    gen = torch.Generator().manual_seed(ggml_type)
    K = 576 if quant.GGML_TYPES[ggml_type][1] == 32 else 512  # 576: rows end in part of a chunk
    for N in BF16_OUTPUTS:
        name = f"{quant.GGML_TYPES[ggml_type][0]} N={N} K={K} bf16"
        blocks = torch.from_numpy(random_blocks(ggml_type, N, K, seed=N + K))
        w = quant.ggml_dequantize(blocks, ggml_type)
        for M in BF16_ROWS:
            x = torch.randn(M, K, generator=gen).bfloat16()
            assert_bf16(quant.ggml_linear_bf16(x, blocks, ggml_type), x, w, f"{name} M={M}")
    eye = torch.eye(K, dtype=torch.bfloat16)
    for gemm_rows in (0, K):  # tiles, registers
        y = quant.ggml_linear_bf16(eye, blocks, ggml_type, gemm_rows=gemm_rows)
        assert torch.equal(y.T, w.bfloat16()), f"{name} gemm_rows={gemm_rows}"  # a zero's sign aside


INT_TYPES = [t for t in (Q4_K, Q6_K) if quant.ggml_int_supported(t)]
INT_ROWS = (1, 2, 3, 4, 5, 9, 16, 17)  # register tiles of 1-4 rows and their remainders, the GEMM threshold


def check_int_type(ggml_type: int) -> None:
    """``ggml_qlinear_int`` for one type: ``exact`` within the exact kernels' tolerance and ``q8`` within
    int8 activations' (about 1e-2 of the largest output; 5e-2 allowed), both against the float product
    with ggml's weights; bfloat16 ``x`` gives the float32 result rounded once, bit for bit."""
    gen = torch.Generator().manual_seed(100 + ggml_type)
    for N, K in ((1, 256), (33, 512), (300, 2304)):
        name = f"{quant.GGML_TYPES[ggml_type][0]} N={N} K={K} int"
        blocks = torch.from_numpy(random_blocks(ggml_type, N, K, seed=N + K))
        w = quant.ggml_dequantize(blocks, ggml_type)
        for M in INT_ROWS:
            x = torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen)  # rows of other scales
            assert_exact(quant.ggml_qlinear_int(x, blocks, ggml_type, "exact", gemm_rows=16), x, w,
                         f"{name} M={M} exact")
            y, ref = quant.ggml_qlinear_int(x, blocks, ggml_type, "q8"), F.linear(x.double(), w.double())
            error = ((y.double() - ref).abs().max() / ref.abs().max()).item()
            assert 1e-4 < error < 5e-2, f"{name} M={M} q8: relative error {error}"  # int8, not exact, not wrong
            xb = x.bfloat16()
            for mode in ("exact", "q8"):
                got = quant.ggml_qlinear_int(xb, blocks, ggml_type, mode)
                assert got.dtype == torch.bfloat16, f"{name} M={M} {mode} bf16"
                assert torch.equal(got, quant.ggml_qlinear_int(xb.float(), blocks, ggml_type, mode).bfloat16()), \
                    f"{name} M={M} {mode} bf16"
    # A block of x with one value far above the rest: the exact digits still carry the small ones.
    blocks = torch.from_numpy(random_blocks(ggml_type, 16, 256, seed=7))
    w = quant.ggml_dequantize(blocks, ggml_type)
    x = torch.randn(1, 256, generator=gen) * 1e-3
    x[0, ::32] = 1e3
    assert_exact(quant.ggml_qlinear_int(x, blocks, ggml_type, "exact"), x, w, "one large value a block")
    # Blocks of x so small that their third digits' steps would be subnormal (silu of a large negative
    # gate), beside ordinary ones: every digit counts in steps of the block's scale.
    x = torch.randn(2, 256, generator=gen)
    x[:, 64:128] *= 1e-33
    x[1] *= 1e-3
    assert_exact(quant.ggml_qlinear_int(x, blocks, ggml_type, "exact"), x, w, "blocks near float32's smallest")


@pytest.mark.parametrize("ggml_type", INT_TYPES)
def test_integer_dot_products_against_the_float_product(ggml_type):
    check_int_type(ggml_type)


def test_integer_dot_products_refuse_what_they_do_not_run():
    blocks = torch.from_numpy(random_blocks(Q4_K, 4, 256))
    with pytest.raises(ValueError, match="mode must be one of"):
        quant.ggml_qlinear_int(torch.randn(1, 256), blocks, Q4_K, "int4")
    with pytest.raises(ValueError, match="mode must be one of"):
        quant.bind_ggml_qlinear_int(blocks, Q4_K, 256, "fast")
    with pytest.raises(ValueError, match="digits must be 1 .* or 3"):
        torch.ops.modelrunner_quant_cpu.ggml_qlinear_int(torch.randn(1, 256), blocks, Q4_K, 2, 24)
    q8_0 = torch.from_numpy(random_blocks(Q8_0, 4, 256))
    assert not quant.ggml_int_supported(Q8_0)
    with pytest.raises(ValueError, match=r"ggml type 8 has no integer-dot kernel in this build"):
        quant.ggml_qlinear_int(torch.randn(1, 256), q8_0, Q8_0)
    if INT_TYPES:
        with pytest.raises(ValueError, match="x has K = 512 features but the blocks hold 256"):
            quant.ggml_qlinear_int(torch.randn(1, 512), blocks, Q4_K)
        with pytest.raises(ValueError, match="x must be float32, got Half"):
            quant.ggml_qlinear_int(torch.randn(1, 256).half(), blocks, Q4_K)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_every_shape_against_the_gguf_dequantizer(ggml_type):
    check_type(ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_bf16_every_shape_against_torch(ggml_type):
    check_bf16_type(ggml_type)


def test_the_bf16_matmul_kernel_takes_a_bf16_engines_activations_as_they_are():
    # cpu_ggml_bf16 computes in bfloat16: a bfloat16 engine hands it bfloat16 (input_dtypes) and gets
    # bfloat16 back, the very values it returns as float32 for the same activations.
    kernel = quant.matmul.CPUGGMLBF16
    assert torch.bfloat16 in kernel.input_dtypes
    blocks = torch.from_numpy(random_blocks(Q4_K, 40, 512))
    q4_k = WeightFormat(4, 32, True, scale_dtype="float32", ggml_type=Q4_K)
    weight = QuantizedWeight(blocks, torch.empty(0), None, q4_k, 40, 512)
    bound = kernel().bind(weight)
    for rows in (1, 100):
        x = torch.randn(rows, 512).bfloat16()
        want = bound(x.float())
        assert want.dtype == torch.float32
        for how, y in (("run", kernel().run(weight, x)), ("bind", bound(x))):
            assert y.dtype == torch.bfloat16 and torch.equal(y.float(), want), (how, rows)


def test_bf16_leading_dimensions_empty_inputs_and_inference_mode():
    blocks = torch.from_numpy(random_blocks(Q6_K, 5, 512))
    w = quant.ggml_dequantize(blocks, Q6_K)
    x = torch.randn(2, 3, 512).bfloat16()
    assert_bf16(quant.ggml_linear_bf16(x, blocks, Q6_K).reshape(6, 5), x.reshape(6, 512), w, "[2, 3, K]")
    assert quant.ggml_linear_bf16(torch.zeros(0, 512, dtype=torch.bfloat16), blocks, Q6_K).shape == (0, 5)
    assert quant.ggml_linear_bf16(torch.zeros(3, 512, dtype=torch.bfloat16), blocks[:0], Q6_K).shape == (3, 0)
    with torch.inference_mode():
        for rows in (1, 100):
            x = torch.randn(rows, 512).bfloat16()
            assert_bf16(quant.ggml_linear_bf16(x, blocks, Q6_K), x, w, f"inference mode, {rows} rows")


def test_q4_k_and_q6_k_are_supported_by_every_build():
    assert Q4_K in TYPES and Q6_K in TYPES


def test_rows_that_end_in_part_of_a_chunk():
    # Q8_0 and Q5_0 rows of blocks of 32 that are not whole chunks of 256 values (SmolLM2's 576).
    for ggml_type in (t for t in TYPES if quant.GGML_TYPES[t][1] == 32):
        blocks = random_blocks(ggml_type, 7, 576)
        w = reference(blocks, ggml_type)
        data = torch.from_numpy(blocks)
        assert torch.equal(quant.ggml_dequantize(data, ggml_type), w)
        for M in (1, 2, 5):
            x = torch.randn(M, 576)
            assert_exact(quant.ggml_qlinear(x, data, ggml_type), x, w, f"type {ggml_type} K=576 M={M}")


def test_leading_dimensions_empty_inputs_and_inference_mode():
    blocks = torch.from_numpy(random_blocks(Q4_K, 5, 512))
    w = reference(blocks.numpy(), Q4_K)
    x = torch.randn(2, 3, 512)
    assert_exact(quant.ggml_qlinear(x, blocks, Q4_K).reshape(6, 5), x.reshape(6, 512), w, "[2, 3, K]")
    assert quant.ggml_qlinear(torch.randn(0, 512), blocks, Q4_K).shape == (0, 5)
    assert quant.ggml_qlinear(torch.randn(3, 512), blocks[:0], Q4_K).shape == (3, 0)
    with torch.inference_mode():
        for rows in (1, 100):
            x = torch.randn(rows, 512)
            assert_exact(quant.ggml_qlinear(x, blocks, Q4_K), x, w, f"inference mode, {rows} rows")


def test_the_fake_implementations_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        blocks = torch.empty(5, 2 * 210, dtype=torch.uint8)
        assert quant.ggml_qlinear(torch.empty(3, 512), blocks, Q6_K).shape == (3, 5)
        assert quant.ggml_dequantize(blocks, Q6_K).shape == (5, 512)
        y = quant.ggml_linear_bf16(torch.empty(3, 512, dtype=torch.bfloat16), blocks, Q6_K)
        assert y.shape == (3, 5) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("change,message", [
    (lambda x, b: (x.double(), b, Q4_K), "x must be float32, got Double"),
    (lambda x, b: (x, b.view(torch.int8), Q4_K), "blocks must be uint8 (the file's bytes), got Char"),
    (lambda x, b: (x[:, :300].contiguous(), b, Q4_K), "x has K = 300 features, not a multiple of 256"),
    (lambda x, b: (x, b[:, :145].contiguous(), Q4_K),
     "blocks have 145 bytes per row, not a positive whole number of Q4_K blocks (144 bytes each)"),
    (lambda x, b: (x, b[:, :144].contiguous(), Q4_K), "x has K = 512 features but the blocks hold 256 per row"),
    (lambda x, b: (x, b, 10), "ggml type 10 is not one these kernels run"),
    (lambda x, b: (x.t(), b, Q4_K), "x must be contiguous"),
    (lambda x, b: (x, b.reshape(-1), Q4_K), "blocks must be 2-D"),
    (lambda x, b: (x, b[:, ::2], Q4_K), "blocks must be contiguous"),
])
def test_bad_input_is_refused_by_name(change, message):
    x, blocks = torch.randn(2, 512), torch.from_numpy(random_blocks(Q4_K, 2, 512))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        quant.ggml_qlinear(*change(x, blocks))


@pytest.mark.parametrize("change,message", [
    (lambda x, b: (x.float(), b, Q4_K), "x must be bfloat16, got Float"),
    (lambda x, b: (x, b.view(torch.int8), Q4_K), "blocks must be uint8 (the file's bytes), got Char"),
    (lambda x, b: (x[:, :300].contiguous(), b, Q4_K), "x has K = 300 features, not a multiple of 256"),
    (lambda x, b: (x, b[:, :144].contiguous(), Q4_K), "x has K = 512 features but the blocks hold 256 per row"),
    (lambda x, b: (x, b, 10), "ggml type 10 is not one these kernels run"),
    (lambda x, b: (x.t(), b, Q4_K), "x must be contiguous"),
    (lambda x, b: (x, b[:, ::2], Q4_K), "blocks must be contiguous"),
])
def test_bf16_bad_input_is_refused_by_name(change, message):
    x, blocks = torch.randn(2, 512).bfloat16(), torch.from_numpy(random_blocks(Q4_K, 2, 512))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        quant.ggml_linear_bf16(*change(x, blocks))
    with pytest.raises(ValueError, match="x has K = 256 features but the blocks hold 512 per row"):
        quant.bind_ggml_linear_bf16(blocks, Q4_K, 256)


def test_bad_input_to_dequantize_and_bind_is_refused_by_name():
    blocks = torch.from_numpy(random_blocks(Q6_K, 2, 512))
    with pytest.raises(ValueError, match="ggml type 3 is not one these kernels run"):
        quant.ggml_dequantize(blocks, 3)
    with pytest.raises(ValueError, match="not a positive whole number of Q4_K blocks"):
        quant.ggml_dequantize(blocks, Q4_K)  # 420 bytes: Q6_K's
    with pytest.raises(ValueError, match="x has K = 256 features but the blocks hold 512 per row"):
        quant.bind_ggml_qlinear(blocks, Q6_K, 256)


def test_the_cpu_ggml_kernel():
    kernel = quant.matmul.CPUGGML
    assert kernel in quant.MATMUL_KERNELS and kernel.name == "cpu_ggml" and kernel.exact
    assert set(TYPES) <= set(kernel.ggml_types)
    q4_k = WeightFormat(4, 32, True, scale_dtype="float32", ggml_type=Q4_K)
    assert kernel.supports(q4_k, "cpu") and not kernel.supports(q4_k, "meta")
    assert not kernel.supports(WeightFormat(4, 32, True, scale_dtype="float32"), "cpu")  # planar: not its
    assert not kernel.supports(WeightFormat(4, 16, True, scale_dtype="float32", ggml_type=10), "cpu")  # Q2_K
    blocks = random_blocks(Q4_K, 33, 512)
    w = reference(blocks, Q4_K)
    weight = QuantizedWeight(torch.from_numpy(blocks), torch.empty(0), None, q4_k, 33, 512)
    bound = kernel().bind(weight)
    for M in (1, 40):
        x = torch.randn(M, 512)
        assert_exact(kernel().run(weight, x), x, w, f"run M={M}")
        assert_exact(bound(x), x, w, f"bind M={M}")


def test_the_integer_dot_product_kernels():
    split, q8 = quant.matmul.CPUGGMLSplit, quant.matmul.CPUGGMLQ8
    assert {split, q8} <= set(quant.MATMUL_KERNELS)
    assert split.name == "cpu_ggml_split" and split.exact and split.activation_kind() == "float"
    assert q8.name == "cpu_ggml_q8" and not q8.exact and q8.activation_kind() == "int8"
    assert torch.bfloat16 in split.input_dtypes and torch.bfloat16 in q8.input_dtypes
    q4_k = WeightFormat(4, 32, True, scale_dtype="float32", ggml_type=Q4_K)
    q8_0 = WeightFormat(8, 32, False, scale_dtype="float32", ggml_type=Q8_0)
    for kernel in (split, q8):
        assert kernel.supports(q4_k, "cpu") == (Q4_K in INT_TYPES) and not kernel.supports(q4_k, "meta")
        assert not kernel.supports(q8_0, "cpu")  # no integer kernel for Q8_0: cpu_ggml runs it
        assert not kernel.supports(WeightFormat(4, 32, True, scale_dtype="float32"), "cpu")  # planar
    if Q4_K not in INT_TYPES:
        pytest.skip("the integer-dot kernels need the AVX-512 VNNI build")
    assert split().build_id() == quant.matmul.CPUGGML().build_id()
    blocks = random_blocks(Q4_K, 33, 512)
    w = reference(blocks, Q4_K)
    weight = QuantizedWeight(torch.from_numpy(blocks), torch.empty(0), None, q4_k, 33, 512)
    for M in (1, 40):
        x = torch.randn(M, 512)
        assert_exact(split().run(weight, x), x, w, f"run M={M}")
        assert_exact(split().bind(weight)(x), x, w, f"bind M={M}")
        assert torch.equal(q8().bind(weight)(x), q8().run(weight, x))
        assert q8().bind(weight)(x.bfloat16()).dtype == torch.bfloat16


def test_the_cpu_ggml_bf16_kernel():
    from modelrunner.api import native_bf16

    kernel = quant.matmul.CPUGGMLBF16
    assert kernel in quant.MATMUL_KERNELS and kernel.name == "cpu_ggml_bf16" and not kernel.exact
    assert kernel.activation_kind() == "bf16" and kernel.rounds_weights and kernel.timed == native_bf16()
    assert kernel.ggml_types == quant.matmul.CPUGGML.ggml_types
    q6_k = WeightFormat(8, 16, False, scale_dtype="float32", ggml_type=Q6_K)
    assert kernel.supports(q6_k, "cpu") and not kernel.supports(q6_k, "meta")
    assert not kernel.supports(WeightFormat(8, 16, False, scale_dtype="float32"), "cpu")  # planar: not its
    blocks = random_blocks(Q6_K, 33, 512)
    w = reference(blocks, Q6_K)
    weight = QuantizedWeight(torch.from_numpy(blocks), torch.empty(0), None, q6_k, 33, 512)
    bound = kernel().bind(weight)
    for M in (1, 40):
        x = torch.randn(M, 512)
        want = F.linear(x.bfloat16(), w.bfloat16()).float()
        for how, y in (("run", kernel().run(weight, x)), ("bind", bound(x))):
            assert y.dtype == torch.float32, how
            torch.testing.assert_close(y, want, rtol=1e-2, atol=1e-2 * want.abs().max().item(),
                                       msg=lambda m, how=how, M=M: f"{how} M={M}: {m}")


def test_in_a_bf16_engine_cpu_ggml_bf16_joins_cpu_ggml_for_the_batch_rows(monkeypatch):
    from torch import nn

    from modelrunner.plugins import Plugins
    from modelrunner_quantization.ggml_scheme import GGMLScheme
    from modelrunner_quantization.kernels import KernelSelector

    monkeypatch.setattr(quant.matmul.CPUGGMLBF16, "timed", True)  # as where the CPU computes bf16 natively
    selector = KernelSelector("float", plugins=Plugins())
    scheme = GGMLScheme(Q4_K, selector)
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.empty(64, 512, device="meta"), requires_grad=False)
    scheme.create_storage(layer, 64, 512)
    blocks = nn.Parameter(torch.from_numpy(random_blocks(Q4_K, 64, 512)), requires_grad=False)
    blocks.logical_shape = (64, 512)
    layer.weight = blocks
    assert "cpu_ggml_bf16" not in selector._unfiltered(scheme, layer)  # float32 engine, exact: not its
    selector.dtype = torch.bfloat16
    allowed = selector._unfiltered(scheme, layer)
    assert {"cpu_ggml", "cpu_ggml_bf16"} <= set(allowed)
    assert selector.family_of("cpu_ggml_bf16") == selector.family_of("cpu_ggml") == "float-planar"
    assert selector.in_bucket("cpu_ggml_bf16", "batch") and not selector.in_bucket("cpu_ggml_bf16", "decode")


@pytest.mark.parametrize("variant", ["avx512", "avx2", "generic"])
def test_the_other_instruction_set_builds(variant):
    if not native.runnable(next(v for v in native_build.VARIANTS if v.name == variant)):
        pytest.skip(f"this CPU cannot run the {variant} build")
    if platform.machine() not in ("x86_64", "AMD64") and variant != "generic":
        pytest.skip("x86-64 code paths")
    script = (f"import runpy\nns = runpy.run_path({__file__!r})\nfor t in ns['TYPES']:\n    ns['check_type'](t)\n"
              f"    ns['check_bf16_type'](t)\n"
              f"print('LOADED', ns['quant'].load_ggml(), sorted(ns['TYPES']), 'INT', ns['INT_TYPES'])\n")
    env = {**os.environ, native.VARIANT_ENV: variant}
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"LOADED {variant} [6, 8, 12, 13, 14] INT []" in result.stdout  # integer dot products: VNNI only


def test_without_its_build_the_kernel_claims_nothing(tmp_path):
    # The package as pip leaves it where the build failed: the sources, no libraries.
    shutil.copytree(Path(quant.__file__).parent, tmp_path / "modelrunner_quant_cpu",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    script = textwrap.dedent("""
        import warnings
        from modelrunner.quantization.matmul import WeightFormat
        from modelrunner_quant_cpu.matmul import CPUGGML, CPUGGMLBF16, CPUGGMLSplit
        q4_k = WeightFormat(4, 32, True, scale_dtype="float32", ggml_type=12)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("SUPPORTS", CPUGGML.supports(q4_k, "cpu"), CPUGGMLBF16.supports(q4_k, "cpu"),
                  CPUGGMLSplit.supports(q4_k, "cpu"))
        print("WARNED", [str(w.message) for w in caught])
    """)
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "SUPPORTS False False False" in result.stdout
    assert "the ggml-block kernels are not built for this CPU" in result.stdout
