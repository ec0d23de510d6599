"""The ``matmul_kernels`` plugin kind: kernels registered by plugins are listed, checked, timed and run
by the quantization methods' selector, which never imports a kernel plugin; an unknown name fails
with the known ones."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from modelrunner_kit.conformance import suite
from modelrunner_kit.conformance.matmul import _layer
from modelrunner.errors import UnknownNameError
from modelrunner.plugins import Plugins
from modelrunner_quantization.kernels import KernelSelector, layout_of

from plugin_dists import make_distribution

KERNELS = """
import torch
import torch.nn.functional as F
from modelrunner import hookimpl
from modelrunner.quantization import MatmulKernel, dequantize_planar

class Planar8(MatmulKernel):
    name = "test_planar8"

    @classmethod
    def supports(cls, format, device):
        return format.bits == 8 and torch.device(device).type == "cpu"

    def run(self, weight, x):
        return F.linear(x, dequantize_planar(*weight.storage, weight.format.group_size, weight.format.bits))


class Reversed(MatmulKernel):
    '''A layout of its own: the rows stored in reverse order.'''

    name = "test_reversed"
    layout = "reversed"

    @classmethod
    def pack(cls, weight):
        return tuple(None if t is None else t.flip(0).contiguous() for t in weight.storage)

    @classmethod
    def unpack(cls, weight, ids=None):
        planar = tuple(None if t is None else t.flip(0) for t in weight.storage)
        return planar if ids is None else tuple(None if t is None else t.index_select(0, ids) for t in planar)

    def run(self, weight, x):
        w = dequantize_planar(*weight.storage, weight.format.group_size, weight.format.bits)
        return F.linear(x, w).flip(1)  # the rows are stored reversed: so are the output columns


class Wrong(MatmulKernel):
    name = "test_wrong"
    timed = False  # never chosen unless pinned

    def run(self, weight, x):
        return F.linear(x, dequantize_planar(*weight.storage, weight.format.group_size, weight.format.bits)) * 1.01


@hookimpl
def register(registry):
    registry.matmul_kernels(Planar8, Reversed, Wrong)
"""


@pytest.fixture
def plugins(tmp_path):
    """The process's plugins plus one that registers two matmul kernels."""
    root = make_distribution(tmp_path, "mr-test-matmul", "test-matmul", "mr_test_matmul", KERNELS)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield Plugins(block=["quant-cpu"])  # its timings would only slow these tests
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("mr_test_matmul", None)
        importlib.invalidate_caches()


def test_registered_kernels_are_listed_by_plugin(plugins):
    assert plugins.infos["test-matmul"].provides == {"matmul_kernels": ["test_planar8", "test_reversed", "test_wrong"]}
    assert plugins.infos["quantization"].provides["matmul_kernels"] == [
        "int8_rowwise", "onednn_bf16", "onednn_bf16_int4pack", "reference", "torch_int4pack", "torch_int8pack"]
    assert plugins.registry.capabilities("matmul_kernels", "test_reversed", "test-matmul")["layout"] == "reversed"


def test_an_unknown_kernel_fails_naming_the_known_ones(plugins):
    selector = KernelSelector(kernel="test_planr8")
    with pytest.raises(UnknownNameError, match=r"unknown matmul kernel 'test_planr8'; installed: .*reference.*"
                                               r"test_planar8.*Did you mean 'test_planar8'"):
        selector.use_plugins(plugins)


def test_the_selector_times_the_kernels_that_claim_the_format_and_runs_the_fastest(plugins):
    selector = KernelSelector("float", plugins=plugins)
    scheme, layer = _layer("int8:g32:sym", selector)
    allowed = selector._allowed(scheme, layer)
    # The fallback steps aside; of the two layouts (families) that claim the format, timing keeps one.
    assert allowed and set(allowed) <= {"test_planar8", "test_reversed"}, allowed
    selector.prepare(scheme, layer)
    chosen = selector.choices[selector.key(scheme, layer, "decode")]
    assert chosen in ("test_planar8", "test_reversed")
    x = torch.randn(3, 256)
    torch.testing.assert_close(scheme.apply(layer, x, None), x @ scheme.dequantized(layer).T)
    # int4 weights: test_planar8 does not claim them
    scheme4, layer4 = _layer("int4:g32:mins", KernelSelector("float", plugins=plugins))
    assert "test_planar8" not in scheme4.kernels._allowed(scheme4, layer4)


def test_a_kernel_with_its_own_layout_regroups_the_layer_in_place_and_reads_back(plugins):
    selector = KernelSelector("float", kernel="test_reversed", plugins=plugins)
    scheme, layer = _layer("int4:g32:mins", selector)
    planar = [t.clone() for t in scheme.storage(layer) if t is not None]
    weight = layer.weight
    selector.prepare(scheme, layer)
    assert layout_of(layer) == "reversed" and layer.weight is weight  # the same parameter, data replaced
    assert torch.equal(layer.weight.data, planar[0].flip(0))
    assert all(torch.equal(a, b) for a, b in zip(scheme.planar_storage(layer), planar))
    x = torch.randn(2, 256)
    torch.testing.assert_close(scheme.apply(layer, x, None), x @ scheme.dequantized(layer).T)


def test_a_pinned_kernel_refuses_a_format_it_does_not_claim(plugins):
    selector = KernelSelector("float", kernel="test_planar8", plugins=plugins)
    scheme, layer = _layer("int4:g32:mins", selector)
    with pytest.raises(ValueError, match=r"kernel 'test_planar8' cannot run int4:g32:mins:40x256:decode here"):
        selector.prepare(scheme, layer)


def test_the_conformance_suite_passes_the_kernels_own_and_a_plugins():
    results = suite("matmul_kernels", "reference").run() + suite("matmul_kernels", "int8_rowwise").run()
    assert not [r for r in results if r.status == "failed"], results
    assert sum(r.status == "passed" for r in results) >= 12


def test_the_conformance_suite_fails_a_wrong_kernel(plugins):
    results = {r.check: r for r in suite("matmul_kernels", "test_wrong", plugins=plugins).run()}
    failed = results["int4:g32:mins/rows=5"]  # 1% off
    assert failed.status == "failed" and "differs from the dequantized reference by 0.01" in failed.message
    assert results["refuses-unclaimed-formats"].status == "passed"
    layout = suite("matmul_kernels", "test_reversed", plugins=plugins).run()
    assert not [r for r in layout if r.status == "failed"], layout
