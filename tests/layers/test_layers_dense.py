"""``dense`` and weight planning: every path gives the plain results, a weight whose packed path wins
is kept only packed (and unpacks exactly), choices are timed once and cached, the eager backend
plans what the layers declare, reports it, and can be turned off or pinned to one path."""

from __future__ import annotations

import json

import pytest
import torch

from modelrunner import LLM
from modelrunner.layers import ColumnParallelLinear, ParallelLMHead, VocabParallelEmbedding
from modelrunner.layers.dense import (
    PATHS,
    dense,
    dense_plan,
    onednn_usable,
    packed_weight,
    plan_summary,
    prepack_weights,
    unpack_weights,
)
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


def _tied_model():
    torch.manual_seed(0)
    linear = ColumnParallelLinear(32, 48)
    embedding, head = VocabParallelEmbedding(100, 32), ParallelLMHead(100, 32)
    for p in (linear.weight, embedding.weight):
        torch.nn.init.normal_(p)
    head.tie(embedding)
    return linear, embedding, head, torch.nn.ModuleList([linear, embedding, head])


def test_packed_path_keeps_one_copy_and_unpacks_exactly():
    linear, embedding, head, model = _tied_model()
    plain = linear.weight.detach().clone()
    x = torch.randn(5, 32)
    before = (linear(x), head(x))
    assert prepack_weights(model, path="onednn_packed") == (48 * 32 + 100 * 32) * 4  # the tied weight counts once
    assert packed_weight(linear.weight) is not None and packed_weight(embedding.weight) is not None
    # The linear weight is kept only packed; the tied one keeps its plain rows for the embedding lookup.
    assert linear.weight.is_meta and tuple(linear.weight.shape) == (48, 32)
    assert not embedding.weight.is_meta and head.weight is embedding.weight
    assert plan_summary(model)["released_plain_bytes"] == 48 * 32 * 4
    for a, b in zip(before, (linear(x), head(x))):
        assert (a - b).abs().max().item() < 1e-4
    unpack_weights(model)
    assert torch.equal(linear.weight, plain) and linear.weight.weight_loader is not None
    assert packed_weight(linear.weight) is None and packed_weight(head.weight) is None


@pytest.mark.parametrize("path", ["mkl", "onednn"])
def test_unpacked_paths_keep_no_packed_copy(path):
    linear, _, head, model = _tied_model()
    x = torch.randn(20, 32)
    before = linear(x)
    assert prepack_weights(model, path=path) == 0
    assert dense_plan(linear.weight).decode == path and not linear.weight.is_meta
    assert (linear(x) - before).abs().max().item() < 1e-4


def test_timed_plans_are_cached_and_never_hold_two_copies_of_an_unshared_weight(tmp_path):
    linear, _, head, model = _tied_model()
    x = torch.randn(3, 32)
    before = linear(x)
    total = prepack_weights(model, cache_dir=tmp_path)
    # Each weight is timed on its own (a loaded machine may pack one and not the other): the bytes
    # returned are those of the weights whose plan holds a packed copy.
    packed_bytes = sum(w.numel() * 4 for w in {id(w): w for w in (linear.weight, head.weight)}.values()
                       if dense_plan(w) is not None and dense_plan(w).packed is not None)
    assert total == packed_bytes
    cached = json.loads((tmp_path / "kernels.json").read_text())
    (choices,) = cached.values()
    assert {"dense:fp32:48x32:decode", "dense:fp32:48x32:batch"} <= set(choices)
    plan = dense_plan(linear.weight)
    assert plan.decode in PATHS and plan.batch in PATHS
    uses_packed = "onednn_packed" in (plan.decode, plan.batch)
    assert (plan.packed is not None) == uses_packed
    if plan.plain_released:  # one copy: then every input size takes the packed path
        assert plan.decode == plan.batch == "onednn_packed" and linear.weight.is_meta
    assert (linear(x) - before).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="dense path must be 'auto' or one of mkl, onednn, onednn_packed, got 'blas'"):
        prepack_weights(model, path="blas")


def test_prepacked_experts_give_the_same_mixture():
    torch.manual_seed(0)
    moe = FusedMoE(num_experts=4, top_k=2, hidden_size=32, intermediate_size=24, renormalize=True)
    moe.w13_weight.weight_loader(moe.w13_weight, torch.randn(4, 48, 32) * 0.2)
    moe.w2_weight.weight_loader(moe.w2_weight, torch.randn(4, 32, 24) * 0.2)
    hidden, logits = torch.randn(9, 32), torch.randn(9, 4)
    expected = moe(hidden, logits)
    assert prepack_weights(moe, path="onednn_packed") == (4 * 48 * 32 + 4 * 32 * 24) * 4
    assert len(packed_weight(moe.w13_weight)) == 4 and moe.w13_weight.is_meta
    assert (moe(hidden, logits) - expected).abs().max().item() < 1e-5
    unpack_weights(moe)
    assert (moe(hidden, logits) - expected).abs().max().item() < 1e-5


def test_cpu_fused_plans_dense_weights_and_reports_it(tiny_llama_dir):
    kw = dict(dtype="float32", device="cpu", kv_cache_memory=2**20, block_size=4, compile=True,
              compile_backend="cpu_fused")
    on = LLM(str(tiny_llama_dir), compile_options={"dense_path": "onednn_packed"}, **kw)
    off = LLM(str(tiny_llama_dir), compile_options={"prepack_weights": False}, **kw)
    packed = on.runner.stats()["compile"]
    assert packed["backend"] == "cpu_fused" and packed["prepacked_weight_bytes"] > 0
    assert packed["dense"]["released_plain_bytes"] > 0
    assert set(packed["dense"]["paths"].values()) == {"onednn_packed / onednn_packed"}
    assert off.runner.stats()["compile"]["prepacked_weight_bytes"] == 0
    ids = [5, 9, 14, 2, 7]
    assert (on.runner.forward(ids) - off.runner.forward(ids)).abs().max().item() < 1e-4
    auto = LLM(str(tiny_llama_dir), **kw)
    assert (auto.runner.forward(ids) - off.runner.forward(ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize("options, message", [
    ({"prepack_weights": "yes"}, r"'prepack_weights' must be true or false, got 'yes'"),
    ({"dense_path": "blas"}, r"'dense_path' must be 'auto' or one of mkl, onednn, onednn_packed, got 'blas'"),
    ({"prepack": True}, r"the cpu_fused backend has no option 'prepack' \(options: prepack_weights, fused_ops, "
                        r"decode_graphs, unhooked_calls, dense_path\)"),
])
def test_cpu_fused_options_are_checked(tiny_llama_dir, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), device="cpu", kv_cache_memory=2**20, compile=True, compile_backend="cpu_fused",
            compile_options=options)


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
