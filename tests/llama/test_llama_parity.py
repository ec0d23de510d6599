"""The native Llama-family adapter on a paged cache, step by step: only the asked rows, its cache
spec, bfloat16. (Its logits against transformers, for every config variant, are the adapter
conformance suite's: tests/conformance/test_adapters.py.)"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from modelrunner.config import CacheConfig, RunnerConfig
from modelrunner.plugins import get_plugins
from modelrunner_kit.testing import PagedDriver, load_adapter

TOLERANCE = 1e-4
"""Largest absolute logit difference accepted in float32."""

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
"""With head_dim 16 and 32 original positions, every branch of the llama3 scaling is exercised."""

CONFIGS = {
    "llama-gqa-tied": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama-gqa-untied-biases": lambda: LlamaConfig(**TINY, tie_word_embeddings=False, attention_bias=True,
                                                   mlp_bias=True),
    "llama-mha": lambda: LlamaConfig(**{**TINY, "num_key_value_heads": 4}, tie_word_embeddings=False),
    "llama3-rope-scaling": lambda: LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE),
    "mistral-sliding-window": lambda: MistralConfig(**TINY, sliding_window=6),
    "qwen2-qkv-bias": lambda: Qwen2Config(**TINY, tie_word_embeddings=False),
    "qwen2-sliding-layers": lambda: Qwen2Config(**TINY, tie_word_embeddings=True, use_sliding_window=True,
                                                sliding_window=5, max_window_layers=1),
}


def _checkpoint(name: str, path):
    """A random transformers model for config ``name`` (every weight and bias non-trivial), saved to ``path``."""
    config = CONFIGS[name]()
    config.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM"}[config.model_type]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return model


def _load(path, block_size: int = 4, dtype: torch.dtype = torch.float32):
    plugins = get_plugins(allow=["llama"])
    model = load_adapter(path, RunnerConfig(cache=CacheConfig(block_size=block_size)), plugins=plugins, dtype=dtype)
    assert model.loaded.adapter == "llama"
    return model


def _reference(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_forward_returns_only_the_asked_rows(tmp_path):
    reference = _checkpoint("llama-gqa-tied", tmp_path)
    model = _load(tmp_path, block_size=16)
    driver = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=8)
    prompts = {10: [1, 2, 3, 4, 5], 11: [9, 8, 7]}
    logits = driver.step(prompts)  # last token of each sequence only
    assert logits.shape == (2, 128)
    for row, tokens in zip(logits, prompts.values()):
        assert (row - _reference(reference, tokens)[-1]).abs().max().item() <= TOLERANCE


def test_kv_cache_spec_and_registration(tmp_path):
    _checkpoint("qwen2-qkv-bias", tmp_path)
    model = _load(tmp_path, block_size=8)
    loaded, plugins = model.loaded, model.plugins
    spec = loaded.kv_cache_spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.block_size) == (
        2, 2, 16, torch.float32, 8)
    assert loaded.tokenizer is None  # the tiny checkpoint ships no tokenizer
    names = plugins.registry.by_plugin("llama")["architectures"]
    assert names == ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]


def test_bfloat16_weights_and_cache(tmp_path):
    reference = _checkpoint("qwen2-qkv-bias", tmp_path)
    model = _load(tmp_path, dtype=torch.bfloat16)
    loaded = model.loaded
    assert loaded.kv_cache_spec.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    driver = PagedDriver(model.forward, loaded.kv_cache_spec, num_blocks=16)
    prompt = [3, 14, 15, 92, 65, 35, 89]
    logits = driver.step({0: prompt}, all_logits=True)
    logits = torch.cat([logits, driver.step({0: [79]}, all_logits=True)])
    assert logits.dtype == torch.float32
    expected = _reference(reference, prompt + [79])
    assert (logits - expected).abs().max().item() < 0.1 * expected.abs().max().item()


def test_forward_hooks_on_any_part_still_run(tmp_path):
    # The decoder calls its parts' forward directly when nothing hooks them; a hook (on a part, or
    # global) must still run, and may change the output.
    _checkpoint("llama-gqa-tied", tmp_path)
    model = _load(tmp_path)
    driver = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=8)
    plain = driver.step({0: [1, 2, 3]})
    layer = model.loaded.model.model.layers[1]
    seen: list[str] = []
    handles = [layer.self_attn.qkv_proj.register_forward_hook(lambda m, a, out: seen.append("qkv")),
               layer.mlp.register_forward_pre_hook(lambda m, a: seen.append("mlp")),
               layer.register_forward_hook(lambda m, a, out: (out[0] * 0, out[1]))]
    zeroed = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=8).step({0: [1, 2, 3]})
    assert seen == ["qkv", "mlp"] and not torch.equal(zeroed, plain)
    for h in handles:
        h.remove()
    counted: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: counted.append(type(m).__name__))
    try:
        again = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=8).step({0: [1, 2, 3]})
    finally:
        handle.remove()
    assert torch.equal(again, plain) and "RMSNorm" in counted and "GatedMLP" in counted
