"""Building on meta and materialising once keeps loaders and ties; load_weights routes packed tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from modelrunner.layers import ParallelLMHead, QKVParallelLinear, RotaryEmbedding, VocabParallelEmbedding
from modelrunner.loading.weights import CheckpointError, iter_weights, load_weights, materialize


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = VocabParallelEmbedding(10, 8)
        self.qkv_proj = QKVParallelLinear(8, 2, 4, 2, bias=True)
        self.rope = RotaryEmbedding(2, 16)
        self.head = ParallelLMHead(10, 8)
        self.head.tie(self.embed)


def test_materialize_keeps_loaders_ties_and_recomputes_buffers():
    with torch.device("meta"):
        model = Tiny()
    materialize(model, "cpu", torch.bfloat16)
    assert model.head.weight is model.embed.weight
    assert model.embed.weight.dtype == torch.bfloat16 and model.embed.weight.device.type == "cpu"
    assert callable(model.qkv_proj.weight.weight_loader)
    assert not model.qkv_proj.weight.requires_grad
    torch.testing.assert_close(model.rope.cos_sin_cache, RotaryEmbedding(2, 16).cos_sin_cache.bfloat16())


def _fp8_storage(keep_dtype: bool | None) -> nn.Module:
    """A layer whose quantization method swapped its weight for float16 storage (as an fp8 method would)."""
    with torch.device("meta"):
        layer = nn.Linear(8, 4, bias=False)
    storage = nn.Parameter(torch.empty(4, 8, dtype=torch.float16, device="meta"), requires_grad=False)
    storage.quant_loader = lambda param, tensor, dst, src=None: None
    if keep_dtype is not None:
        storage.keep_dtype = keep_dtype
    layer.weight = storage
    return nn.Sequential(layer)


def test_materialize_refuses_quantized_storage_that_does_not_say_whether_it_keeps_its_dtype():
    with pytest.raises(ValueError, match=r"quantized storage '0.weight' is float16 but does not set keep_dtype, so "
                                         r"loading would cast it to the model's float32: set param.keep_dtype = True"):
        materialize(_fp8_storage(None), "cpu", torch.float32)
    assert materialize(_fp8_storage(True), "cpu", torch.float32)[0].weight.dtype == torch.float16
    assert materialize(_fp8_storage(False), "cpu", torch.float32)[0].weight.dtype == torch.float32  # cast on purpose


def test_load_weights_routes_packed_projections(tmp_path):
    tensors = {
        "embed.weight": torch.randn(10, 8),
        "q_proj.weight": torch.randn(8, 8), "k_proj.weight": torch.randn(4, 8), "v_proj.weight": torch.randn(4, 8),
        "q_proj.bias": torch.randn(8), "k_proj.bias": torch.randn(4), "v_proj.bias": torch.randn(4),
        "head.weight": torch.randn(10, 8),
    }
    save_file(tensors, str(tmp_path / "weights.safetensors"))
    with torch.device("meta"):
        model = Tiny()
    materialize(model, "cpu", torch.float32)
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    used = load_weights(model, iter_weights(tmp_path), packed, ignore=("head.weight",))
    assert used == set(tensors) - {"head.weight"}
    torch.testing.assert_close(model.qkv_proj.weight, torch.cat([tensors[f"{s}_proj.weight"] for s in "qkv"]))
    torch.testing.assert_close(model.qkv_proj.bias, torch.cat([tensors[f"{s}_proj.bias"] for s in "qkv"]))

    del tensors["v_proj.bias"]
    save_file(tensors, str(tmp_path / "weights.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\) the model needs: v_proj\.bias$"):
        load_weights(model, iter_weights(tmp_path), packed, ignore=("head.weight",))
