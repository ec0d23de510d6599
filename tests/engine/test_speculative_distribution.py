"""Speculative decoding is the ``modelrunner-speculative`` distribution: installed, it provides the
``ngram`` proposer and the speculator the engine builds through the ``modelrunner.speculative`` entry
point; without it, ``speculative_config`` says what to install, and plain decoding runs as before."""

from __future__ import annotations

import pytest
from plugin_dists import hide_distribution


def test_the_distribution_provides_the_proposer_and_the_speculator():
    from modelrunner.plugins import feature_class, get_plugins
    from modelrunner.spec_decode import SPECULATIVE_DIST, SPECULATOR_GROUP
    from modelrunner_speculative import NgramProposer, Speculator

    info = get_plugins().infos["speculative"]
    assert (info.distribution, info.provides) == ("modelrunner-speculative", {"proposers": ["ngram"]})
    assert get_plugins().proposer_class("ngram") is NgramProposer
    assert feature_class(SPECULATOR_GROUP, "speculator", SPECULATIVE_DIST, "speculative_config") is Speculator


def test_without_it_speculative_config_says_what_to_install(monkeypatch, tiny_llama_dir):
    from modelrunner import LLM, ModelRunnerError

    hide_distribution(monkeypatch, "modelrunner-speculative")
    common = {"dtype": "float32", "device": "cpu", "compile": False, "kv_cache_memory": 4 << 20}
    with pytest.raises(ModelRunnerError, match=r"^speculative_config needs the modelrunner-speculative "
                                               r"distribution: pip install modelrunner-speculative$"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **common)
    llm = LLM(str(tiny_llama_dir), **common)
    assert llm.generate("Hello")[0].outputs[0].token_ids
    llm.shutdown()
