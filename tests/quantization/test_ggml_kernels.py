"""The quant-cpu plugin's kernels on ggml's blocks as a GGUF file stores them (``ggml_matmul.cpp``):
``ggml_dequantize`` bit for bit against the ``gguf`` package's dequantizer, ``ggml_qlinear`` against
the float product with those weights (exact kernels: up to summation order) at row counts around
every register tile and on both sides of the GEMM threshold, in the build this CPU loads and in each
other instruction-set build it runs; bad input refused by name; the ``cpu_ggml`` matmul kernel."""

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
from modelrunner.conformance.gguf import random_blocks
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


@pytest.mark.parametrize("ggml_type", TYPES)
def test_every_shape_against_the_gguf_dequantizer(ggml_type):
    check_type(ggml_type)


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


@pytest.mark.parametrize("variant", ["avx512", "avx2", "generic"])
def test_the_other_instruction_set_builds(variant):
    if not native.runnable(next(v for v in native_build.VARIANTS if v.name == variant)):
        pytest.skip(f"this CPU cannot run the {variant} build")
    if platform.machine() not in ("x86_64", "AMD64") and variant != "generic":
        pytest.skip("x86-64 code paths")
    script = (f"import runpy\nns = runpy.run_path({__file__!r})\nfor t in ns['TYPES']:\n    ns['check_type'](t)\n"
              f"print('LOADED', ns['quant'].load_ggml(), sorted(ns['TYPES']))\n")
    env = {**os.environ, native.VARIANT_ENV: variant}
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"LOADED {variant} [6, 8, 12, 13, 14]" in result.stdout


def test_without_its_build_the_kernel_claims_nothing(tmp_path):
    # The package as pip leaves it where the build failed: the sources, no libraries.
    shutil.copytree(Path(quant.__file__).parent, tmp_path / "modelrunner_quant_cpu",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    script = textwrap.dedent("""
        import warnings
        from modelrunner.quantization.matmul import WeightFormat
        from modelrunner_quant_cpu.matmul import CPUGGML
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("SUPPORTS", CPUGGML.supports(WeightFormat(4, 32, True, scale_dtype="float32", ggml_type=12), "cpu"))
        print("WARNED", [str(w.message) for w in caught])
    """)
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "SUPPORTS False" in result.stdout
    assert "the ggml-block kernels are not built for this CPU" in result.stdout
