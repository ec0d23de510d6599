"""The MoE adapter's router logits and expert counts against transformers on the same weights, step by
step on a paged cache. (Its logits are the adapter conformance suite's: tests/conformance/test_adapters.py.)"""

from __future__ import annotations

import attrs
import pytest
import torch

from modelrunner.config import CacheConfig, RunnerConfig
from modelrunner.plugins import get_plugins
from modelrunner_kit.testing import AdapterUnderTest, PagedDriver, load_adapter

from .checkpoints import CONFIGS, make_config, make_reference, save_checkpoint

TOLERANCE = 1e-4
"""Largest absolute logit difference accepted in float32."""


def load(path, block_size: int = 4, dtype: torch.dtype = torch.float32) -> tuple[AdapterUnderTest, object]:
    """The checkpoint at ``path`` through the moe plugin's load, parallelize and compile hooks."""
    model = load_adapter(path, RunnerConfig(cache=CacheConfig(block_size=block_size)),
                         plugins=get_plugins(allow=["moe"]), dtype=dtype)
    assert model.loaded.adapter == "moe"
    return model, model.loaded


def driver_for(model: AdapterUnderTest, loaded, num_blocks: int = 64) -> PagedDriver:
    return PagedDriver(model.forward, loaded.kv_cache_spec, num_blocks=num_blocks)


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """``(name, transformers reference, checkpoint dir)`` for each architecture."""
    reference = make_reference(make_config(request.param))
    path = save_checkpoint(reference, tmp_path_factory.mktemp(request.param))
    return request.param, reference, path


def test_router_logits_match_transformers(checkpoint):
    name, reference, path = checkpoint
    model_, loaded = load(path)
    driver = driver_for(model_, loaded)
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
    batch = attrs.evolve(driver.build({0: tokens}, all_logits=True), extra={"return_router_logits": True})
    out = model_.forward(batch, driver.kv_caches)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens]), output_router_logits=True).router_logits
    sparse = [i for i, s in enumerate(loaded.model.spec.sparse_layers) if s]
    assert [i for i, _ in loaded.model.moe_layers] == sparse and len(out.aux["router_logits"]) == len(expected)
    worst = 0.0
    for ours, theirs in zip(out.aux["router_logits"], expected):
        assert ours.shape == theirs.shape == (len(tokens), loaded.model.spec.num_experts)
        worst = max(worst, (ours - theirs).abs().max().item())
        # The same experts chosen for every token, in the same order.
        assert torch.equal(ours.topk(2).indices, theirs.topk(2).indices)
    print(f"{name}: max |router logits - transformers| = {worst:.2e}")
    assert worst <= 1e-5

    # Without the request (and without output_router_logits in the config) no router logits are returned.
    plain = driver_for(model_, loaded)
    batch = plain.build({0: tokens})
    assert model_.forward(batch, plain.kv_caches).aux == {}


def test_expert_token_counts_follow_routing(checkpoint):
    name, _, path = checkpoint
    model_, loaded = load(path)
    driver = driver_for(model_, loaded)
    model = loaded.model
    tokens = [7, 1, 99, 23, 54]
    batch = attrs.evolve(driver.build({0: tokens}, all_logits=True), extra={"return_router_logits": True})
    router_logits = model_.forward(batch, driver.kv_caches).aux["router_logits"]
    stats = model.runner_stats()
    top_k, experts = model.spec.top_k, model.spec.num_experts
    expected = [torch.bincount(r.topk(top_k).indices.flatten(), minlength=experts).tolist() for r in router_logits]
    assert stats["last_step_expert_token_counts"] == stats["expert_token_counts"] == expected
    assert all(sum(c) == len(tokens) * top_k for c in expected)
    driver.step({0: [8]})
    stats = model.runner_stats()
    assert [sum(c) for c in stats["expert_token_counts"]] == [(len(tokens) + 1) * top_k] * len(expected)
    assert [sum(c) for c in stats["last_step_expert_token_counts"]] == [top_k] * len(expected)


def test_config_output_router_logits_returns_them_on_every_step(tmp_path):
    config = make_config("mixtral")
    config.output_router_logits = True
    path = save_checkpoint(make_reference(config), tmp_path)
    model_, loaded = load(path)
    driver = driver_for(model_, loaded)
    batch = driver.build({0: [1, 2, 3], 1: [4, 5]})
    out = model_.forward(batch, driver.kv_caches)
    assert [r.shape for r in out.aux["router_logits"]] == [(5, 4), (5, 4)]
    # A batch may still opt out.
    batch = attrs.evolve(driver.build({0: [6], 1: [7]}), extra={"return_router_logits": False})
    assert model_.forward(batch, driver.kv_caches).aux == {}


def test_bfloat16_weights_and_cache(tmp_path):
    reference = make_reference(make_config("qwen2_moe"))
    path = save_checkpoint(reference, tmp_path)
    model_, loaded = load(path, dtype=torch.bfloat16)
    assert loaded.kv_cache_spec.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    driver = driver_for(model_, loaded, num_blocks=16)
    prompt = [3, 14, 15, 92, 65, 35, 89]
    logits = driver.step({0: prompt}, all_logits=True)
    assert logits.dtype == torch.float32
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    assert (logits - expected).abs().max().item() < 0.1 * expected.abs().max().item()


def test_llama_models_are_left_to_the_llama_adapter(tiny_llama_dir):
    model_ = load_adapter(tiny_llama_dir, plugins=get_plugins(allow=["moe", "llama"]))
    assert model_.loaded.adapter == "llama"
