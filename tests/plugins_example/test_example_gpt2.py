"""The README's example adapter (tests/plugins/example_gpt2) works through the public API alone:
it is listed, chosen for GPT-2 checkpoints, loads both tensor layouts and refuses parallel runs.
(Its logits and greedy tokens against transformers are the adapter conformance suite's:
tests/conformance/test_adapters.py, case example-gpt2.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config

from modelrunner import LLM
from modelrunner.parallel_state import ParallelState
from modelrunner_kit.testing import load_adapter

@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, smollm2_tokenizer, save_checkpoint):
    """A 2-layer random GPT-2 (hidden 64, 4 heads) with SmolLM2's tokenizer."""
    tok = smollm2_tokenizer
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=len(tok), n_positions=256,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config.architectures = ["GPT2LMHeadModel"]
    return save_checkpoint(config, tok, tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="module")
def llm(gpt2_dir):
    return LLM(model=str(gpt2_dir), dtype="float32")


def test_listed_with_its_hooks_and_architecture():
    out = subprocess.run([sys.executable, "-m", "modelrunner.cli", "plugins", "--json"],
                         capture_output=True, text=True, check=True).stdout
    plugin = {p["name"]: p for p in json.loads(out)}["example_gpt2"]
    assert plugin["distribution"] == "modelrunner-example-gpt2" and plugin["error"] is None
    assert plugin["hooks"] == ["forward", "load", "parallelize", "register"]
    assert plugin["provides"] == {"architectures": ["GPT2LMHeadModel"]}


def test_chosen_over_the_generic_adapter(llm):
    assert llm.runner.loaded.adapter == "example_gpt2"
    assert llm.runner.loaded.kv_cache_spec.num_layers == 2


def test_loads_checkpoints_saved_without_the_transformer_prefix(gpt2_dir, tmp_path, llm):
    """Like openai-community/gpt2: tensors named ``h.0.…``/``wte.weight``, plus old causal-mask buffers."""
    shutil.copytree(gpt2_dir, tmp_path, dirs_exist_ok=True)
    stored = load_file(str(gpt2_dir / "model.safetensors"))
    tensors = {name.removeprefix("transformer."): t for name, t in stored.items()}
    tensors |= {f"h.{i}.attn.bias": torch.ones(1, 1, 256, 256) for i in range(2)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_adapter(tmp_path).loaded
    assert not [w for w in caught if "tensor(s) the model does not use" in str(w.message)]
    expected = llm.runner.loaded.model.state_dict()
    assert all(torch.equal(t, expected[name]) for name, t in loaded.model.state_dict().items())


def test_parallel_runs_are_refused_clearly(llm):
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        load_adapter(llm.runner.runner.source).parallelize(ParallelState(tp_size=2))
