"""modelrunner-quantization's library matmul kernels (``torch_int4pack``, ``torch_int8pack``, ``onednn_bf16``,
``onednn_bf16_int4pack``): their deviation from the dequantized reference on GGUF-like data, the
int4pack layout's exact way back to planar, the ``bf16`` family of activations in the selector (and
in a bfloat16 engine, where it is exact and weight-rounding kernels run batches only), and the
conformance suite through ``modelrunner check``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from modelrunner_kit.conformance.matmul import _layer, planar_weight, reference_matmul
from modelrunner.plugins import Plugins
from modelrunner.quantization import QuantizedWeight, WeightFormat
from modelrunner_quantization import library
from modelrunner_quantization.kernels import KernelSelector, layout_of
from modelrunner_quantization.library import OneDNNBF16, OneDNNBF16Int4Pack, TorchInt4Pack, TorchInt8Pack
from modelrunner.quantization.planar_layout import dequantize_planar, pack_int4

from plugin_dists import run_cli

BF16_RTOL = 1e-2
"""Largest |difference| / max |reference| of a bf16-activation kernel (measured 3e-3 to 5e-3)."""

needs_int4pack = pytest.mark.skipif(library.int4pack_order() is None,
                                    reason="this torch has no int4 packing the kernel can read back")


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def gguf_like(kind: str, rows: int = 72, cols: int = 256, seed: int = 0) -> QuantizedWeight:
    """A planar weight as a GGUF file's blocks convert to it: Q4_1 (scale and min per 32), Q4_0 (scale,
    min = -8·scale), Q8_0 (int8, scale per 32, no mins)."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(rows, cols // 32, generator=gen) * 0.01 + 1e-3).half()
    if kind == "Q8_0":
        q = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
        return QuantizedWeight(q, d, None, WeightFormat(8, 32, False), rows, cols)
    q = pack_int4(torch.randint(0, 16, (rows, cols), generator=gen))
    m = (-8 * d.float()).half() if kind == "Q4_0" else (torch.randn(rows, cols // 32, generator=gen) * 0.05).half()
    return QuantizedWeight(q, d, m, WeightFormat(4, 32, True), rows, cols)


def packed(weight: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(*TorchInt4Pack.pack(weight), weight.format, weight.rows, weight.cols, "int4pack")


@needs_int4pack
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4pack_maps_gguf_groups_exactly_and_reads_them_back(kind):
    weight = gguf_like(kind, rows=72)  # not a multiple of the 64-row tile: padded
    mine = packed(weight)
    assert mine.data.shape == (128, 128) and mine.scales.dtype == torch.bfloat16
    # The planar bytes, scales and mins come back exactly: all rows, and a few (an embedding lookup).
    for got, want in zip(TorchInt4Pack.unpack(mine), weight.storage):
        assert torch.equal(got, want)
    ids = torch.tensor([71, 0, 33, 5])
    for got, want in zip(TorchInt4Pack.unpack(mine, ids), weight.storage):
        assert torch.equal(got, want.index_select(0, ids))
    if kind == "Q4_0":
        assert not mine.scales[..., 1].any()  # zero = m + 8·d = 0
    # With float32 activations and the same (d, m + 8·d) the op is the float matmul: the mapping is exact.
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    want = reference_matmul(weight, x)
    d, m = weight.scales.float(), weight.mins.float()
    exact_pairs = torch.zeros(8, 128, 2)
    exact_pairs[:, :72] = torch.stack((d, m + 8 * d), -1).transpose(0, 1)
    fp32 = torch.ops.aten._weight_int4pack_mm_for_cpu(x, mine.data, 32, exact_pairs)[:, :72]
    assert relative(fp32, want) < 1e-6
    # The kernel itself takes bf16 activations and bf16 (d, z): within bf16's rounding.
    kernel = TorchInt4Pack()
    for got in (kernel.run(mine, x), kernel.bind(mine)(x)):
        assert got.shape == (5, 72) and got.dtype == torch.float32 and got.is_contiguous()
        assert relative(got, want) < BF16_RTOL


def test_int8pack_claims_per_row_int8_only_and_stays_within_bf16_rounding():
    assert TorchInt8Pack.supports(WeightFormat(8, 256, False, True), "cpu")
    assert not TorchInt8Pack.supports(WeightFormat(8, 32, False), "cpu")  # Q8_0: a scale per 32, not per row
    assert not TorchInt8Pack.supports(WeightFormat(4, 32, True), "cpu")
    weight = planar_weight("int8:per-row:sym")
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(2))
    kernel = TorchInt8Pack()
    for got in (kernel.run(weight, x), kernel.bind(weight)(x)):
        assert relative(got, reference_matmul(weight, x)) < BF16_RTOL


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_onednn_bf16_works_in_bounded_chunks_and_is_timed_only_where_bf16_is_native(kind, monkeypatch):
    weight = gguf_like(kind, rows=72)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    want = reference_matmul(weight, x)
    whole = OneDNNBF16().run(weight, x)
    monkeypatch.setattr(library, "BF16_CHUNK_BYTES", 16 * 256 * 2)  # 16 rows at a time: 5 chunks
    chunked = OneDNNBF16().run(weight, x)
    assert relative(whole, want) < BF16_RTOL and relative(chunked, want) < BF16_RTOL
    flags = library.cpu_flags()
    assert OneDNNBF16.timed == bool({"amx_bf16", "avx512_bf16"} & flags)


@needs_int4pack
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_onednn_bf16_on_int4pack_computes_what_it_computes_on_planar(kind, monkeypatch):
    weight = gguf_like(kind, rows=200)  # four 64-row tiles, the last one padded
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(library, "BF16_CHUNK_BYTES", 64 * 256 * 2)  # 64 rows a chunk for both
    got, want = OneDNNBF16Int4Pack().run(packed(weight), x), OneDNNBF16().run(weight, x)
    assert got.shape == (9, 200) and torch.equal(got, want)  # the same bf16 values, the same GEMMs
    assert torch.equal(OneDNNBF16Int4Pack().bind(packed(weight))(x), got)
    assert relative(got, reference_matmul(weight, x)) < BF16_RTOL
    assert OneDNNBF16Int4Pack.rounds_weights and OneDNNBF16.rounds_weights and not TorchInt4Pack.rounds_weights
    assert OneDNNBF16Int4Pack.layout == TorchInt4Pack.layout == "int4pack"


@pytest.fixture(scope="module")
def plugins():
    return Plugins(block=["quant-cpu"])  # the kernel's own kernels: their timings stay short


@needs_int4pack
@pytest.mark.parametrize("activations, kinds", [
    ("float", {"float"}),
    ("int8", {"float"}),  # no int8 kernel claims int4 without the quant-cpu plugin: exact ones run
    ("bf16", {"bf16"}),
    ("auto", {"bf16"}),  # the fallback (reference, float) steps aside where anything else runs
])
def test_the_bf16_family_runs_only_where_the_activations_option_allows_it(plugins, activations, kinds):
    selector = KernelSelector(activations, plugins=plugins)
    scheme, layer = _layer("int4:g32:mins", selector)
    allowed = selector._unfiltered(scheme, layer)
    assert {selector.candidates[n].activation_kind() for n in allowed} == kinds
    assert ("torch_int4pack" in allowed) == ("bf16" in kinds)
    assert ("onednn_bf16" in allowed) == (OneDNNBF16.timed and "bf16" in kinds)
    assert selector.family_of("torch_int4pack") == "bf16-int4pack" and selector.family_of("reference") == "float-planar"


def test_bf16_falls_back_to_exact_kernels_where_no_bf16_kernel_claims_the_format(plugins):
    selector = KernelSelector("bf16", plugins=plugins)
    scheme, layer = _layer("int8:g32:sym", selector)  # Q8_0: torch_int8pack takes per-row scales only
    allowed = selector._unfiltered(scheme, layer)
    assert allowed == (["onednn_bf16"] if OneDNNBF16.timed else ["reference"])
    scheme, layer = _layer("int8:per-row:sym", KernelSelector("bf16", plugins=plugins))
    assert "torch_int8pack" in scheme.kernels._unfiltered(scheme, layer)


@needs_int4pack
def test_in_a_bf16_engine_bf16_kernels_are_exact_and_weight_rounding_ones_run_batches_only(plugins, monkeypatch):
    # Timed here even where bf16 is emulated: the rule, not the speed, is under test.
    monkeypatch.setattr(OneDNNBF16, "timed", True)
    monkeypatch.setattr(OneDNNBF16Int4Pack, "timed", True)
    fp32 = KernelSelector("float", plugins=plugins)
    scheme, layer = _layer("int4:g32:mins", fp32)
    assert set(fp32._unfiltered(scheme, layer)) == {"reference"}  # float32 activations: exact kernels only
    selector = KernelSelector("float", plugins=plugins)
    selector.dtype = torch.bfloat16
    scheme, layer = _layer("int4:g32:mins", selector)
    allowed = selector._unfiltered(scheme, layer)
    assert {"torch_int4pack", "onednn_bf16", "onednn_bf16_int4pack"} <= set(allowed)
    assert selector.kind_of("torch_int4pack") == "float" and selector.family_of("torch_int4pack") == "float-int4pack"
    # The reference steps aside where others cover both buckets; then planar (onednn_bf16 alone) has no
    # kernel for one row, and int4pack (torch_int4pack on one row, oneDNN on many) is the family.
    assert "reference" not in allowed and selector._complete(allowed) == {"float-int4pack"}
    for name in ("onednn_bf16", "onednn_bf16_int4pack"):
        assert selector.in_bucket(name, "batch") and not selector.in_bucket(name, "decode")
        assert not fp32.in_bucket(name, "batch")
    selector.prepare(scheme, layer)
    decode, batch = (selector.key(scheme, layer, b) for b in ("decode", "batch"))
    assert selector.choices[decode] == "torch_int4pack" and layout_of(layer) == "int4pack"
    assert set(selector.timings[batch]) == {"torch_int4pack", "onednn_bf16_int4pack"}
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5)).bfloat16().float()
    assert relative(scheme.apply(layer, x, None), x @ scheme.dequantized(layer).T) < BF16_RTOL


@needs_int4pack
@pytest.mark.parametrize("pinned", [None, "reference"])
def test_a_bf16_engine_hands_its_activations_to_a_kernel_as_they_are(plugins, monkeypatch, pinned):
    # A bfloat16 engine's layer takes and gives bfloat16. A kernel that takes them (input_dtypes:
    # torch_int4pack, oneDNN) gets them as they are and rounds its float32 sums once; one that does not
    # (the reference) gets float32 and its output is rounded; with a bias, float32 throughout, the bias
    # added before the one rounding. Each equals the float32 path on the same values, rounded.
    monkeypatch.setattr(OneDNNBF16, "timed", True)
    monkeypatch.setattr(OneDNNBF16Int4Pack, "timed", True)
    seen: list[torch.dtype] = []
    for cls in (TorchInt4Pack, OneDNNBF16Int4Pack, OneDNNBF16, type(KernelSelector("float", plugins=plugins)
                                                                   .candidates["reference"])):
        original = cls.bind

        def spy(self, weight, original=original):
            run = original(self, weight)
            return lambda x: (seen.append(x.dtype), run(x))[1]
        monkeypatch.setattr(cls, "bind", spy)
    selector = KernelSelector("float", plugins=plugins, kernel=pinned)
    selector.dtype = torch.bfloat16
    scheme, layer = _layer("int4:g32:mins", selector)
    selector.prepare(scheme, layer)
    bias = torch.randn(layer.weight.logical_shape[0]).bfloat16()
    for rows in (1, 40):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        float_path = scheme.apply(layer, x.float(), None)
        seen.clear()
        got = scheme.apply(layer, x, None)
        assert got.dtype == torch.bfloat16 and torch.equal(got, float_path.bfloat16()), rows
        assert seen == [torch.float32 if pinned else torch.bfloat16], (rows, seen)
        seen.clear()
        with_bias = scheme.apply(layer, x, bias)
        assert torch.equal(with_bias, (float_path + bias).bfloat16()) and seen == [torch.float32], rows


def test_in_a_bf16_engine_families_are_timed_without_weight_rounding_on_one_row(monkeypatch):
    every = Plugins()  # the quant-cpu plugin's families too, where its kernels load
    monkeypatch.setattr(OneDNNBF16, "timed", True)
    monkeypatch.setattr(OneDNNBF16Int4Pack, "timed", True)
    selector = KernelSelector("float", plugins=every)
    selector.dtype = torch.bfloat16
    scheme, layer = _layer("int4:g32:mins", selector)
    families = selector._complete(selector._unfiltered(scheme, layer))
    if len(families) < 2:
        pytest.skip(f"one family here ({', '.join(families)}): no family timing to check")
    selector.prepare(scheme, layer)
    decode, batch = (selector.key(scheme, layer, b) for b in ("decode", "batch"))
    assert not selector.candidates[selector.choices[decode]].rounds_weights  # one row stays exact
    assert not {"onednn_bf16", "onednn_bf16_int4pack"} & set(selector.timings[decode])
    assert {"onednn_bf16", "onednn_bf16_int4pack", "torch_int4pack"} <= set(selector.timings[batch])
    assert selector.family_of(selector.choices[decode]) == selector.family_of(selector.choices[batch])


def test_an_unknown_activations_value_names_bf16():
    with pytest.raises(ValueError, match=r"activations must be 'float', 'int8', 'bf16' or 'auto', got 'fp16'"):
        KernelSelector("fp16")


@needs_int4pack
def test_a_layer_on_the_bf16_family_is_regrouped_in_place_and_reads_back_planar(plugins):
    selector = KernelSelector("bf16", plugins=plugins)
    scheme, layer = _layer("int4:g32:mins", selector)
    planar = [t.clone() for t in scheme.storage(layer)]
    want = F.linear(torch.ones(1, 256), dequantize_planar(*planar, 32, 4))
    selector.prepare(scheme, layer)
    assert layout_of(layer) == "int4pack"  # torch_int4pack's layout in place
    assert selector.choices[selector.key(scheme, layer, "decode")] == "torch_int4pack"
    # Batches: the op itself, or oneDNN's bf16 GEMM from its layout where the CPU computes bf16 (AMX).
    assert selector.choices[selector.key(scheme, layer, "batch")] in {"torch_int4pack", "onednn_bf16_int4pack"}
    assert all(torch.equal(a, b) for a, b in zip(scheme.planar_storage(layer), planar))
    for rows in (1, 40):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        assert relative(scheme.apply(layer, x, None), x @ scheme.dequantized(layer).T) < BF16_RTOL
    assert relative(scheme.apply(layer, torch.ones(1, 256), None), want) < BF16_RTOL


def test_modelrunner_check_passes_the_library_kernels():
    result = run_cli("check", "quantization", "--kind", "matmul_kernels", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    by_suite: dict[str, dict[str, str]] = {}
    for r in report["results"]:
        by_suite.setdefault(r["suite"], {})[r["check"]] = r["status"]
    for name in ("torch_int4pack", "torch_int8pack", "onednn_bf16"):
        statuses = by_suite[f"matmul_kernels:{name}"]
        assert "failed" not in statuses.values(), statuses
        assert statuses["refuses-unclaimed-formats"] == "passed"
    assert by_suite["matmul_kernels:torch_int8pack"]["int8:per-row:sym/rows=64"] == "passed"
    assert by_suite["matmul_kernels:onednn_bf16"]["int8:g32:sym/rows=5"] == "passed"
    if library.int4pack_order() is not None:
        assert by_suite["matmul_kernels:torch_int4pack"]["int4:g128:mins/rows=1"] == "passed"
