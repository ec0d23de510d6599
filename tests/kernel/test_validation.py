"""Bad input at the lower API gets a ValueError naming the bad value, never a raw IndexError from
deep inside torch or a silently shifted output."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from modelrunner import LLM, ModelRunner, SamplingParams
from modelrunner.plugins import get_plugins


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, kv_cache_memory=8 << 20)


@pytest.mark.parametrize(("ids", "match"), [
    (torch.tensor([1.0, 2.0]), r"input_ids must be integer token ids .* got float32"),
    (torch.tensor([1, 2, 10**6]), r"token id 1000000, outside the vocabulary \(accepted: 0 … 49151\)"),
    (torch.tensor([-1]), r"token id -1, outside the vocabulary"),
    (torch.zeros(1, 0, dtype=torch.long), r"shape \[L\] or \[B, L\] with L > 0"),
])
def test_forward_refuses_bad_ids(llm, ids, match):
    with pytest.raises(ValueError, match=match):
        llm.runner.forward(ids)


@pytest.mark.parametrize(("messages", "match"), [
    ([{"role": "user"}], r"message 0 has no 'content'"),
    ([{"content": "hi"}], r"message 0 has no 'role'"),
    ([{"role": "user", "content": 42}], r"message 0: content must be a string or a list of parts, got int"),
    ([{"role": 1, "content": "hi"}], r"message 0: role must be a string, got 1"),
    (["hi"], r"message 0 must be a dict"),
    ([], r"messages must be a non-empty list"),
])
def test_chat_refuses_malformed_messages(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, use_tqdm=False)


def test_a_forward_hook_returning_the_wrong_number_of_rows_is_named(tiny_llama_dir):
    runner = ModelRunner({"model": str(tiny_llama_dir), "device": "cpu", "kv_cache_memory": 8 << 20})
    runner.load_model()
    model = runner.loaded.model
    real = model.compute_logits
    model.compute_logits = lambda hidden: torch.cat([real(hidden), real(hidden[:1])])  # one row too many
    with pytest.raises(ValueError, match=r"adapter 'llama''s forward hook returned logits of shape \[4, 49152\] "
                                         r"for 3 requested rows \(batch.logits_indices\); expected \[3, vocab\]"):
        runner.forward([1, 2, 3])


def test_a_checkpoint_without_a_tokenizer_takes_token_ids_only(tiny_llama_dir, tmp_path):
    for file in tiny_llama_dir.iterdir():
        if not file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, tmp_path / file.name)
    llm = LLM(str(tmp_path), device="cpu", kv_cache_memory=8 << 20)
    assert llm.get_tokenizer() is None
    with pytest.raises(ValueError, match=r"ships no tokenizer, so prompts must be token ids"):
        llm.generate("hello", use_tqdm=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer, so it has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


def test_a_block_size_the_attention_backend_cannot_serve_is_refused_before_loading(tiny_llama_dir):
    if "cpu_paged" not in get_plugins().attention_backends("cpu"):
        pytest.skip("cpu_paged is not available here")
    runner = ModelRunner({"model": str(tiny_llama_dir), "attention_backend": "cpu_paged", "block_size": 512})
    with pytest.raises(ValueError, match=r"attention backend 'cpu_paged' serves block_size up to 256, got "
                                         r"block_size=512"):
        runner.load_model()
    assert runner.loaded is None


def test_a_quantized_checkpoint_is_refused_naming_its_method(tiny_llama_dir, tmp_path):
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantized with 'fp8' \(quantization_config in config.json\), which no "
                                         r"installed quantization method reads"):
        LLM(str(tmp_path), device="cpu")


def test_integer_weights_are_never_cast_to_float(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = torch.randint(-8, 8, tensors[name].shape, dtype=torch.int8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor '{name}' is stored as int8, a quantized form; modelrunner never "
                                         r"casts integer or fp8 weights to float without their scales"):
        LLM(str(tmp_path), device="cpu")
