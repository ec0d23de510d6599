"""Checkpoints whose config describes absurd sizes are refused before anything is built: through
``LLM(...)`` and through ``modelrunner generate`` (one line, exit 2), in seconds, naming the estimate,
the memory available and the config fields behind it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from modelrunner.model_size import ModelTooLargeError, estimate_weights


def _checkpoint(root: Path, **sizes: int) -> Path:
    """A Llama config.json (made by transformers' config class) with ``sizes``, plus a stand-in
    safetensors file: the weights are never read when the size check works."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
                            "max_position_embeddings": 512, "tie_word_embeddings": False, **sizes})
    config.architectures = ["LlamaForCausalLM"]
    root.mkdir()
    config.save_pretrained(str(root))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 256)}, str(root / "model.safetensors"))
    return root


@pytest.fixture(scope="module")
def absurd(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("absurd")
    return {"vocab": _checkpoint(root / "vocab", vocab_size=10**9),
            "layers": _checkpoint(root / "layers", num_hidden_layers=10**6)}


EXPECTED = {
    "vocab": "embeddings and LM head: vocab_size=1000000000 × hidden_size=256 (2,048.0 GB)",
    "layers": "decoder layers: num_hidden_layers=1000000 × (hidden_size=256, num_attention_heads=4, "
              "num_key_value_heads=2, intermediate_size=512)",
}


@pytest.mark.parametrize("case", ["vocab", "layers"])
def test_llm_refuses_an_absurd_config_before_building_it(absurd, case):
    from modelrunner import LLM

    started = time.monotonic()
    with pytest.raises(ModelTooLargeError) as info:
        LLM(model=str(absurd[case]), dtype="float32")
    assert time.monotonic() - started < 30
    message = str(info.value)
    assert "the model's weights need at least" in message and "is available on cpu" in message, message
    assert EXPECTED[case] in message, message


@pytest.mark.parametrize("case", ["vocab", "layers"])
def test_generate_refuses_an_absurd_config_in_one_line(absurd, case):
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "modelrunner.cli", "generate", "--model", str(absurd[case]),
                             "--set", "dtype=float32", "hi"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert time.monotonic() - started < 60
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("modelrunner: error:")]
    assert len(errors) == 1 and "the model's weights need at least" in errors[0], result.stderr
    assert EXPECTED[case] in errors[0], result.stderr


def test_the_estimate_is_close_to_a_real_model_and_never_above_it(tiny_llama_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(tiny_llama_dir))
    real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    estimate = estimate_weights(config, 4.0)
    assert 0.95 * real <= estimate.parameters <= real
