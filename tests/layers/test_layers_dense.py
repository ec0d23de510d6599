"""``dense`` and weight prepacking: the packed path gives the unpacked results, the eager backend
packs what the layers declare, reports it, and can be turned off."""

from __future__ import annotations

import pytest
import torch

from modelrunner import LLM
from modelrunner.layers import ColumnParallelLinear, ParallelLMHead, VocabParallelEmbedding
from modelrunner.layers.dense import dense, onednn_usable, packed_weight, prepack_weights, unpack_weights
from modelrunner.layers.fused_moe import FusedMoE

pytestmark = pytest.mark.skipif(not onednn_usable(), reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_dense_on_packed_weights_equals_plain_linear(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 96, generator=g), torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    expected = torch.nn.functional.linear(x, w, b)
    assert (dense(x, w, b) - expected).abs().max().item() < 1e-4
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    assert (dense(x, w, b, packed=packed) - expected).abs().max().item() < 1e-4


def test_prepack_packs_declared_weights_once_and_tied_weights_once():
    torch.manual_seed(0)
    linear = ColumnParallelLinear(32, 48)
    embedding, head = VocabParallelEmbedding(100, 32), ParallelLMHead(100, 32)
    for p in (linear.weight, embedding.weight):
        torch.nn.init.normal_(p)
    head.tie(embedding)
    model = torch.nn.ModuleList([linear, embedding, head])
    x = torch.randn(5, 32)
    before = (linear(x), head(x))
    assert prepack_weights(model) == (48 * 32 + 100 * 32) * 4  # the tied weight counts once
    assert packed_weight(linear.weight) is not None and packed_weight(embedding.weight) is not None
    after = (linear(x), head(x))
    for a, b in zip(before, after):
        assert (a - b).abs().max().item() < 1e-4
    unpack_weights(model)
    assert packed_weight(linear.weight) is None and packed_weight(head.weight) is None


def test_prepacked_experts_give_the_same_mixture():
    torch.manual_seed(0)
    moe = FusedMoE(num_experts=4, top_k=2, hidden_size=32, intermediate_size=24, renormalize=True)
    moe.w13_weight.weight_loader(moe.w13_weight, torch.randn(4, 48, 32) * 0.2)
    moe.w2_weight.weight_loader(moe.w2_weight, torch.randn(4, 32, 24) * 0.2)
    hidden, logits = torch.randn(9, 32), torch.randn(9, 4)
    expected = moe(hidden, logits)
    assert prepack_weights(moe) == (4 * 48 * 32 + 4 * 32 * 24) * 4
    assert len(packed_weight(moe.w13_weight)) == 4
    assert (moe(hidden, logits) - expected).abs().max().item() < 1e-5


def test_eager_backend_prepacks_by_default_and_reports_it(tiny_llama_dir):
    kw = dict(dtype="float32", device="cpu", kv_cache_memory=2**20, block_size=4)
    on = LLM(str(tiny_llama_dir), **kw)
    off = LLM(str(tiny_llama_dir), compile_options={"prepack_weights": False}, **kw)
    packed = on.runner.stats()["compile"]
    assert packed["backend"] == "eager" and packed["prepacked_weight_bytes"] > 0
    assert off.runner.stats()["compile"]["prepacked_weight_bytes"] == 0
    ids = [5, 9, 14, 2, 7]
    assert (on.runner.forward(ids) - off.runner.forward(ids)).abs().max().item() < 1e-4


def test_prepack_option_must_be_a_bool(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"'prepack_weights' must be true or false, got 'yes'"):
        LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=2**20, compile_options={"prepack_weights": "yes"})


@pytest.mark.parametrize("onednn", [True, False])
def test_compiled_graphs_call_onednn_linear_only_when_asked(onednn):
    from modelrunner.layers.dense import onednn_in_compiled_graphs

    torch.manual_seed(0)
    linear = ColumnParallelLinear(32, 48)
    torch.nn.init.normal_(linear.weight)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(linear, backend=backend, fullgraph=True)  # fullgraph: no graph break in dense
    x = torch.randn(3, 32)
    with onednn_in_compiled_graphs(onednn), torch.inference_mode():
        out = compiled(x)
    assert (out - torch.nn.functional.linear(x, linear.weight)).abs().max().item() < 1e-4
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert ("modelrunner.onednn_linear.default" in targets or "modelrunner.onednn_linear" in targets) == onednn
