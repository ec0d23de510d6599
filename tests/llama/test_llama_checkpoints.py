"""Bad checkpoints fail with errors that name the file or tensor; unknown architectures are left to others."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from modelrunner.config import RunnerConfig
from modelrunner.errors import UnknownNameError
from modelrunner.plugins import get_plugins
from modelrunner.runner import ModelRunner
from modelrunner_kit.testing import load_adapter
from modelrunner.loading.weights import CheckpointError

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.fixture
def checkpoint(tmp_path):
    config = LlamaConfig(**TINY)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    return tmp_path


def _load(path):
    return load_adapter(path, RunnerConfig(), plugins=get_plugins(allow=["llama"])).loaded


def _shard(path):
    """Rewrite the checkpoint as two shards with an index; return the shard names."""
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    for file, part in zip(files, halves):
        save_file({n: tensors[n] for n in part}, str(path / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in zip(files, halves) for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def test_sharded_checkpoint_loads(checkpoint):
    _shard(checkpoint)
    loaded = _load(checkpoint)
    assert loaded.model.lm_head.weight.abs().sum() > 0


def test_missing_shard_is_named(checkpoint):
    files = _shard(checkpoint)
    (checkpoint / files[1]).unlink()
    with pytest.raises(CheckpointError, match=rf"model\.safetensors\.index\.json.*{files[1]}"):
        _load(checkpoint)


def test_no_weight_file_names_the_directory(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"{checkpoint}.*no weight file"):
        _load(checkpoint)


def test_wrong_shape_names_file_tensor_and_shapes(checkpoint):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    bad = "model.layers.1.self_attn.k_proj.weight"
    tensors[bad] = torch.zeros(16, 64)
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        _load(checkpoint)
    msg = str(e.value)
    assert "model.safetensors" in msg and bad in msg and "expected shape [32, 64], got [16, 64]" in msg


def test_missing_tensor_is_named(checkpoint):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"], tensors["lm_head.weight"]
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks 2 tensor\(s\).*model\.layers\.0\.mlp\.up_proj\.weight, lm_head\.weight"):
        _load(checkpoint)


def test_unused_tensor_warns(checkpoint):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old checkpoints: skipped silently
    tensors["model.extra_thing.weight"] = torch.ones(3)
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"ignored 1 tensor\(s\).*model\.extra_thing\.weight"):
        _load(checkpoint)


def test_unknown_architecture_is_left_to_the_kernel(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    plugins = get_plugins(allow=["llama"], block=["default-transformers"])
    runner = ModelRunner(RunnerConfig.from_dict({"model": str(checkpoint), "device": "cpu"}), plugins=plugins)
    with pytest.raises(UnknownNameError, match=r"FancyNewForCausalLM.*LlamaForCausalLM"):
        runner.load_model()


def test_native_adapter_wins_and_generic_takes_over_when_excluded(tiny_llama_dir):
    assert load_adapter(tiny_llama_dir, plugins=get_plugins(allow=["llama"])).loaded.adapter == "llama"
    assert load_adapter(tiny_llama_dir, plugins=get_plugins(allow=[])).loaded.adapter == "default-transformers"
