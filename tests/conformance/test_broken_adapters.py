"""Deliberately broken plugins, installed as real distributions, that the conformance suites must
catch with a message naming the defect: adapters built on modelrunner-llama's model that load a
weight transposed or drop Mistral's sliding window; int4 methods whose matmul drops the scale or
takes the next group's, or whose stored scales of one layer are 1% too large; and an int8 method
that accepts GGUF files but not their blocks."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from modelrunner_kit.conformance import suite
from modelrunner_kit.conformance.base import run_check
from modelrunner.plugins import Plugins, get_plugins
from plugin_dists import make_distribution

TRANSPOSED_O_PROJ = '''
"""modelrunner-llama's Llama with every o_proj weight loaded transposed (square here: no shape error)."""
from modelrunner import hookimpl
from modelrunner.api import build_and_load, loaded_for
from modelrunner_llama import forward, parallelize  # the real adapter's other hooks
from modelrunner_llama.model import LlamaForCausalLM


def transposed_o_proj(weights):
    for name, tensor in weights:
        yield name, tensor.t().contiguous() if name.endswith("o_proj.weight") else tensor


@hookimpl
def register(registry):
    registry.architectures("LlamaForCausalLM", tensor_parallel=True, devices=("cpu",))


@hookimpl
def load(source, config, device, dtype, parallel, attention_backend, max_model_len):
    model = build_and_load(lambda: LlamaForCausalLM(source.hf_config, max_model_len, parallel, attention_backend),
                           source, device, dtype, transform=transposed_o_proj)
    return loaded_for(model, source, config, dtype)
'''

NO_SLIDING_WINDOW = '''
"""modelrunner-llama's model for Mistral, built without the checkpoint's sliding window."""
import copy

from modelrunner import hookimpl
from modelrunner.api import build_and_load, loaded_for
from modelrunner_llama import forward, parallelize
from modelrunner_llama.model import LlamaForCausalLM


@hookimpl
def register(registry):
    registry.architectures("MistralForCausalLM", devices=("cpu",))


@hookimpl
def load(source, config, device, dtype, parallel, attention_backend, max_model_len):
    windowless = copy.deepcopy(source.hf_config)
    windowless.sliding_window = None
    model = build_and_load(lambda: LlamaForCausalLM(windowless, max_model_len, parallel, attention_backend),
                           source, device, dtype)
    return loaded_for(model, source, config, dtype)
'''

BROKEN_INT4 = '''
"""int4 whose matmul dequantizes wrongly: without the scales, or with each group's neighbour's scale."""
import torch
import torch.nn.functional as F

from modelrunner import hookimpl
from modelrunner_quantization.methods import Int4Method, Int8Method
from modelrunner.quantization.planar_layout import dequantize_planar
from modelrunner_quantization.planar import PlanarScheme


class NoScaleScheme(PlanarScheme):
    def apply(self, layer, x, bias):
        qweight, scales, mins = self.storage(layer)
        weight = dequantize_planar(qweight, torch.ones_like(scales), mins, self.group_size, self.bits)
        return F.linear(x.float(), weight, bias).to(x.dtype)


class NextGroupScheme(PlanarScheme):
    def apply(self, layer, x, bias):
        qweight, scales, mins = self.storage(layer)
        weight = dequantize_planar(qweight, scales.roll(1, dims=1), mins, self.group_size, self.bits)
        return F.linear(x.float(), weight, bias).to(x.dtype)


class NoScaleInt4(Int4Method):
    name = "int4_noscale"

    def _scheme(self):
        return NoScaleScheme(4, self.options["group_size"], has_mins=True, kernels=self.kernels, quantize_floats=True)


class NextGroupInt4(Int4Method):
    name = "int4_nextgroup"

    def _scheme(self):
        return NextGroupScheme(4, self.options["group_size"], has_mins=True, kernels=self.kernels,
                               quantize_floats=True)


class NothingInt4(Int4Method):
    """Declares int4 but quantizes no layer: every weight stays dense."""

    name = "int4_nothing"

    def prepare(self, model, source):
        pass


class ScaledInt4(Int4Method):
    """int4 with the stored scales of one layer 1% too large: a storage-side error that moves the
    logits of a tiny model by far less than int4's own rounding does."""

    name = "int4_scaled"

    def process_after_loading(self, model):
        name = next(n for n in self.layers if n.endswith("layers.1.mlp.down_proj"))
        model.get_submodule(name).weight_scales.data.mul_(1.01)
        super().process_after_loading(model)


class AnySourceInt8(Int8Method):
    """int8 that does not refuse GGUF files: their Q4_0 blocks reach its per-channel int8 storage."""

    name = "int8_anysource"

    def check_source(self, source):
        pass


@hookimpl
def register(registry):
    registry.quantization_methods(NoScaleInt4, NextGroupInt4, NothingInt4, ScaledInt4, AnySourceInt8)
'''


@contextmanager
def installed(tmp_path: Path, entry: str, source: str, also: tuple[str, ...] = ()) -> Iterator[Plugins]:
    """Plugins loading only the defaults, the installed entry points ``also`` and the entry point
    ``entry`` of a distribution laid out under ``tmp_path`` (on ``sys.path`` for the duration)."""
    get_plugins()  # the process's own plugins are loaded before the broken one is on the path
    module = f"mr_conformance_{entry}"
    root = make_distribution(tmp_path / "site", f"modelrunner-{entry.replace('_', '-')}", entry, module, source)
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        plugins = Plugins(allow=[entry, *also])
        assert entry in plugins.infos and not plugins.broken, plugins.broken
        yield plugins
    finally:
        sys.path.remove(str(root))
        sys.modules.pop(module, None)
        importlib.invalidate_caches()


def _results(checked, names: set[str]) -> dict:
    return {c.name: run_check(checked.title, c) for c in checked.checks() if c.name in names}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """One checkpoint folder for the module."""
    return tmp_path_factory.mktemp("broken-conformance")


def test_a_transposed_o_proj_fails_the_logits_check(tmp_path, root):
    with installed(tmp_path, "transposed_o_proj", TRANSPOSED_O_PROJ) as plugins:
        checked = suite("architectures", "LlamaForCausalLM", plugins=plugins, root=root)
        assert checked.plugin == "transposed_o_proj"
        results = _results(checked, {"logits", "greedy/chunked-prefill"})
    logits = results["logits"]
    assert logits.status == "failed"
    assert "logits differ from transformers' by up to" in logits.message
    assert "(first at position 0), tolerance 0.0001" in logits.message
    assert results["greedy/chunked-prefill"].status == "failed"
    assert "differs from transformers' greedy tokens" in results["greedy/chunked-prefill"].message


def test_a_dropped_sliding_window_fails_past_the_window(tmp_path, root):
    with installed(tmp_path, "no_window", NO_SLIDING_WINDOW) as plugins:
        checked = suite("architectures", "MistralForCausalLM", plugins=plugins, root=root)
        results = _results(checked, {"logits", "greedy/attention=torch_sdpa"})
    window = checked.hf_config.sliding_window
    logits = results["logits"]
    assert logits.status == "failed"
    # Positions inside the window are right; the first one that must not see the first token is not.
    assert f"(first at position {window})" in logits.message, logits.message
    assert results["greedy/attention=torch_sdpa"].status == "failed"


def test_a_tensor_parallel_check_is_not_applicable_to_a_plugin_the_workers_cannot_load(tmp_path, root):
    with installed(tmp_path, "transposed_o_proj", TRANSPOSED_O_PROJ) as plugins:
        checked = suite("architectures", "LlamaForCausalLM", plugins=plugins, root=root)
    # Off the path now: a worker process would not find it.
    result = _results(checked, {"tensor-parallel=2"})["tensor-parallel=2"]
    assert result.status == "skipped"
    assert "tensor-parallel rank 0 would not run plugin 'transposed_o_proj'" in result.message


@pytest.mark.parametrize("method", ["int4_noscale", "int4_nextgroup"])
def test_a_wrong_int4_matmul_fails_the_tolerance_and_layer_checks(tmp_path, root, method):
    # The method needs adapters built from the kernel's layers to cover.
    with installed(tmp_path, "broken_int4", BROKEN_INT4, also=("llama", "moe", "quantization")) as plugins:
        checked = suite("quantization_methods", method, plugins=plugins, root=root, tensor_parallel=False)
        results = _results(checked, {"logits", "layers", "batch-independence"})
    assert results["logits"].status == "failed"
    assert f"with quantization {method!r}: max |logits - dense logits| is" in results["logits"].message
    assert "above the method's conformance_tolerance 0.3" in results["logits"].message
    assert results["layers"].status == "failed"
    assert "model.layers.0.self_attn.qkv_proj (1 rows a call): " in results["layers"].message
    assert "F.linear with the checkpoint's float weight" in results["layers"].message
    assert results["batch-independence"].status == "passed"  # wrong, but consistently so


def test_a_one_percent_scale_error_in_one_layer_fails_the_layer_check(tmp_path, root):
    with installed(tmp_path, "broken_int4", BROKEN_INT4, also=("llama", "moe", "quantization")) as plugins:
        checked = suite("quantization_methods", "int4_scaled", plugins=plugins, root=root, tensor_parallel=False)
        layers = _results(checked, {"layers"})["layers"]
    assert layers.status == "failed"
    assert re.search(r"layers\.1\.mlp\.down_proj \(1 rows a call\): least-squares gain 1\.0(09|10|11)\d of the "
                     r"output against F\.linear with the checkpoint's float weight", layers.message), layers.message


def test_a_method_that_takes_gguf_files_but_not_their_blocks_fails_the_gguf_check(tmp_path, root):
    with installed(tmp_path, "broken_int4", BROKEN_INT4, also=("llama", "moe", "quantization")) as plugins:
        checked = suite("quantization_methods", "int8_anysource", plugins=plugins, root=root, tensor_parallel=False)
        result = _results(checked, {"gguf-source"})["gguf-source"]
    assert result.status == "failed"
    assert "with quantization 'int8_anysource' raised" in result.message
    assert "reach a layer's quant_loader as GGMLBlocks" in result.message


def test_a_method_that_quantizes_nothing_fails_covers_layers(tmp_path, root):
    with installed(tmp_path, "broken_int4", BROKEN_INT4, also=("llama", "moe", "quantization")) as plugins:
        checked = suite("quantization_methods", "int4_nothing", plugins=plugins, root=root, tensor_parallel=False)
        result = _results(checked, {"covers-layers"})["covers-layers"]
    assert result.status == "failed"
    assert "quantization 'int4_nothing' gave no layer of" in result.message and "covers_layers=True" in result.message


BUFFER_FROM_INIT = '''
"""modelrunner-llama's Llama with a per-layer buffer (a GPT-NeoX-style attention scale) computed in __init__."""
import torch
from torch import nn

from modelrunner import hookimpl
from modelrunner.api import build_and_load, loaded_for
from modelrunner_llama import forward, parallelize
from modelrunner_llama.model import LlamaForCausalLM

RESET = {reset}


class AttentionScale(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("norm_factor", torch.tensor(head_dim ** -0.5), persistent=False)

    if RESET:
        def reset_buffers(self):
            self.norm_factor.fill_(self.head_dim ** -0.5)


class ScaledLlama(LlamaForCausalLM):
    def __init__(self, *args):
        super().__init__(*args)
        for layer in self.model.layers:
            layer.scale = AttentionScale(16)


@hookimpl
def register(registry):
    registry.architectures("LlamaForCausalLM", devices=("cpu",))


@hookimpl
def load(source, config, device, dtype, parallel, attention_backend, max_model_len):
    model = build_and_load(lambda: ScaledLlama(source.hf_config, max_model_len, parallel, attention_backend),
                           source, device, dtype)
    return loaded_for(model, source, config, dtype)
'''


def test_a_buffer_computed_in_init_is_named_with_what_to_do(tmp_path, root):
    # Built on meta, the buffer's value is lost; the kernel refuses the model at load, naming each buffer.
    with installed(tmp_path, "buffer_from_init", BUFFER_FROM_INIT.replace("{reset}", "False")) as plugins:
        checked = suite("architectures", "LlamaForCausalLM", plugins=plugins, root=root, tensor_parallel=False)
        logits = _results(checked, {"logits"})["logits"]
    assert logits.status == "failed"
    assert ("raised PluginError: adapter 'buffer_from_init' left buffers without a value after building the model "
            "on the meta device: model.layers.0.scale.norm_factor, model.layers.1.scale.norm_factor (of "
            "AttentionScale). A buffer computed in __init__ is lost there") in logits.message, logits.message
    assert "Compute it in a reset_buffers(self) method of AttentionScale, which materialize() calls" in logits.message


def test_a_buffer_recomputed_in_reset_buffers_loads(tmp_path, root):
    with installed(tmp_path, "buffer_reset", BUFFER_FROM_INIT.replace("{reset}", "True")) as plugins:
        checked = suite("architectures", "LlamaForCausalLM", plugins=plugins, root=root, tensor_parallel=False)
        assert _results(checked, {"logits"})["logits"].status == "passed"
        scale = checked.llm("batched").runner.loaded.model.model.layers[1].scale.norm_factor
    assert float(scale) == 0.25
