"""The project's model adapters through the adapter conformance suite: modelrunner-llama (Llama; Mistral
with its sliding window), modelrunner-moe (Mixtral; Qwen2-MoE), the README's example GPT-2 adapter,
and the kernel's generic transformers adapter on an architecture no plugin registers.

Each tiny checkpoint is written once per session; the tensor-parallel check (a worker process) runs
for Llama only, to keep CI short (the other adapters' tensor parallelism is tested in tests/parallel).
"""

from __future__ import annotations

import pytest
from modelrunner_kit.conformance import NotApplicable, suite
from modelrunner.plugins import get_plugins
from modelrunner.registry import FALLBACK_ARCHITECTURE

CASES = {
    "llama": ("LlamaForCausalLM", "llama", {"tensor_parallel": True}),
    "mistral": ("MistralForCausalLM", "llama", {"tensor_parallel": False}),
    "mixtral": ("MixtralForCausalLM", "moe", {"tensor_parallel": False}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", "moe", {"tensor_parallel": False}),
    "example-gpt2": ("GPT2LMHeadModel", "example_gpt2", {"tensor_parallel": False}),
    "transformers": (FALLBACK_ARCHITECTURE, "default-transformers", {"tensor_parallel": False}),
}
"""Test id → (architecture, plugin, suite options)."""


def _params() -> list:
    params = []
    for case, (name, plugin, options) in CASES.items():
        if plugin not in get_plugins().infos:
            params.append(pytest.param(case, "-", id=case, marks=pytest.mark.skip(
                reason=f"plugin {plugin!r} is not installed")))
            continue
        for check in suite("architectures", name, plugin=plugin, **options).checks():
            params.append(pytest.param(case, check.name, id=f"{case}/{check.name}"))
    return params


@pytest.fixture(scope="module")
def adapter_suites(tmp_path_factory):
    """Test id → its suite, built on first use over one checkpoint folder for the module."""
    root = tmp_path_factory.mktemp("adapter-conformance")
    built: dict[str, object] = {}

    def get(case: str):
        if case not in built:
            name, plugin, options = CASES[case]
            built[case] = suite("architectures", name, plugin=plugin, root=root, **options)
        return built[case]

    return get


@pytest.mark.parametrize(("case", "check"), _params())
def test_adapter_conforms(adapter_suites, case, check):
    found = {c.name: c for c in adapter_suites(case).checks()}
    try:
        found[check].run()
    except NotApplicable as e:
        pytest.skip(str(e))


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
"""With head_dim 16 and 32 original positions, every branch of the llama3 scaling is exercised."""


def _variant(factory, architecture, **kwargs):
    def make():
        config = factory(**kwargs)
        config.architectures = [architecture]
        return config
    return make


def _variants() -> dict:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3MoeConfig

    moe = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
               max_position_embeddings=256)
    return {
        "llama-gqa-tied": ("llama", _variant(LlamaConfig, "LlamaForCausalLM", **TINY, tie_word_embeddings=True)),
        "llama-biases": ("llama", _variant(LlamaConfig, "LlamaForCausalLM", **TINY, tie_word_embeddings=False,
                                           attention_bias=True, mlp_bias=True)),
        "llama-mha": ("llama", _variant(LlamaConfig, "LlamaForCausalLM", **{**TINY, "num_key_value_heads": 4},
                                        tie_word_embeddings=False)),
        "llama3-rope-scaling": ("llama", _variant(LlamaConfig, "LlamaForCausalLM", **TINY,
                                                  rope_parameters=LLAMA3_ROPE)),
        "mistral-window-6": ("llama", _variant(MistralConfig, "MistralForCausalLM", **TINY, sliding_window=6)),
        "qwen2-qkv-bias": ("llama", _variant(Qwen2Config, "Qwen2ForCausalLM", **TINY, tie_word_embeddings=False)),
        "qwen2-sliding-layers": ("llama", _variant(Qwen2Config, "Qwen2ForCausalLM", **TINY, tie_word_embeddings=True,
                                                   use_sliding_window=True, sliding_window=5, max_window_layers=1)),
        # 3 layers, layer 1 dense; q/k norms; renormalised top-2 of 8; tied embeddings.
        "qwen3-moe": ("moe", _variant(Qwen3MoeConfig, "Qwen3MoeForCausalLM", **moe, head_dim=16,
                                      intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                                      norm_topk_prob=True, tie_word_embeddings=True)),
    }


@pytest.mark.parametrize("variant", list(_variants()))
def test_config_variants_give_transformers_logits(variant, tmp_path_factory):
    """Each architectural variant an adapter handles (tied heads, biases, rope scaling, windows per
    layer, q/k norms) through the suite's logits check: every position, across blocks and chunks."""
    plugin, make = _variants()[variant]
    if plugin not in get_plugins().infos:
        pytest.skip(f"plugin {plugin!r} is not installed")
    config = make()
    checked = suite("architectures", config.architectures[0], plugin=plugin, config=config,
                    root=tmp_path_factory.mktemp(variant), tensor_parallel=False)
    {c.name: c for c in checked.checks()}["logits"].run()


def test_the_fallback_is_checked_on_an_architecture_no_plugin_registers(adapter_suites):
    checked = adapter_suites("transformers")
    assert checked.architecture not in checked.plugins.registry.providers["architectures"]
    assert checked.llm("batched").runner.loaded.adapter == "default-transformers"


def test_a_plugin_that_does_not_provide_the_architecture_is_refused():
    with pytest.raises(ValueError, match=r"plugin 'moe' does not provide architecture 'LlamaForCausalLM'; it is "
                                         r"provided by 'llama'"):
        suite("architectures", "LlamaForCausalLM", plugin="moe")


def test_the_fallback_hands_the_cache_over_under_the_name_the_models_forward_takes():
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; under the wrong name the cache is
    swallowed by ``**kwargs`` and every decode step runs without its context."""
    from modelrunner.defaults.transformers_adapter import _cache_argument

    class Before:
        def forward(self, input_ids=None, past_key_values=None, position_ids=None, **kwargs): ...

    class After:
        def forward(self, input_ids=None, cache=None, position_ids=None, **kwargs): ...

    assert _cache_argument(Before()) == "past_key_values"
    assert _cache_argument(After()) == "cache"
