"""Every expert layout loads to the same model; broken checkpoints and configs fail with clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelrunner.plugins import get_plugins
from modelrunner.loading.weights import CheckpointError
from modelrunner_moe import MoeSpec

from .checkpoints import CONFIGS, make_config, make_reference, save_checkpoint
from .test_moe_parity import driver_for, load

PROMPTS = {0: [5, 9, 2, 77, 31, 8, 100], 1: [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]}


def _logits(path) -> torch.Tensor:
    plugins, loaded = load(path)
    driver = driver_for(plugins, loaded, num_blocks=16)
    return torch.cat([driver.step(PROMPTS, all_logits=True), driver.step({0: [11], 1: [12]}, all_logits=True)])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_and_per_expert_layouts_give_the_same_logits(name, tmp_path):
    reference = make_reference(make_config(name))
    per_expert = save_checkpoint(reference, tmp_path / "per_expert")
    fused = save_checkpoint(reference, tmp_path / "fused", layout="fused")
    names = set(load_file(str(per_expert / "model.safetensors")))
    # What transformers 5.24 writes: Mixtral's original block_sparse_moe / w1 w2 w3, Qwen's gate/up/down_proj.
    legacy = "model.layers.0.block_sparse_moe.experts.3.w3.weight" if name == "mixtral" else \
        "model.layers.{}.mlp.experts.3.up_proj.weight".format(0 if name == "qwen3_moe" else 1)
    assert legacy in names
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in load_file(str(fused / "model.safetensors")))
    a, b = _logits(per_expert), _logits(fused)
    assert torch.equal(a, b)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPTS[0] + [11]])).logits[0]
    assert (torch.cat([a[:7], a[18:19]]) - expected).abs().max().item() <= 1e-4


def _rewrite(path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_a_missing_expert_is_named_with_the_accepted_layouts(tmp_path):
    path = save_checkpoint(make_reference(make_config("mixtral")), tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\) the model needs: "
                                              r"model\.layers\.1\.mlp\.experts\.2\.up_proj;.*"
                                              r"per expert \(mlp\.experts\.<e>\.gate_proj/up_proj/down_proj"):
        load(path)


def test_a_fused_tensor_with_too_few_experts_is_rejected(tmp_path):
    path = save_checkpoint(make_reference(make_config("qwen3_moe")), tmp_path, layout="fused")
    _rewrite(path, lambda t: t.update({"model.layers.2.mlp.experts.down_proj":
                                       t["model.layers.2.mlp.experts.down_proj"][:6].contiguous()}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.mlp\.experts\.down_proj'.*"
                                              r"expected shape \[8, 64, 32\], got \[6, 64, 32\]"):
        load(path)


@pytest.mark.parametrize("name,key,value,message", [
    ("mixtral", "num_experts_per_tok", 5,
     r"MixtralForCausalLM \(num_experts_per_tok vs num_local_experts\): top_k=5 experts per token is not "
     r"possible with num_experts=4; top_k must be between 1 and 4"),
    ("qwen3_moe", "num_experts_per_tok", 9, r"Qwen3MoeForCausalLM .*top_k=9 .* num_experts=8"),
    ("qwen2_moe", "decoder_sparse_step", 0, r"decoder_sparse_step must be a positive integer, got 0"),
    ("qwen2_moe", "hidden_act", "gelu", r"hidden_act 'gelu' is not supported \(only 'silu'\)"),
])
def test_bad_moe_configs_fail_at_load(name, key, value, message, tmp_path):
    path = save_checkpoint(make_reference(make_config(name)), tmp_path)
    config = json.loads((path / "config.json").read_text())
    config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load(path)


def test_spec_rejects_other_model_types():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=r"model_type 'llama' is not an MoE model this adapter runs; "
                                         r"supported: mixtral, qwen2_moe, qwen3_moe"):
        MoeSpec.from_config(LlamaConfig())


def test_the_plugin_registers_its_architectures():
    names = get_plugins(allow=["moe"]).registry.by_plugin("moe")["architectures"]
    assert names == ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]
