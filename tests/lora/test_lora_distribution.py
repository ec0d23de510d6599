"""LoRA is the ``modelrunner-lora`` distribution: installed, it provides the ``torch`` kernel and the
manager the runner builds through the ``modelrunner.lora`` entry point; without it, ``enable_lora``
says what to install, and a model without LoRA loads as before."""

from __future__ import annotations

import pytest
from plugin_dists import hide_distribution


def test_the_distribution_provides_the_kernel_and_the_manager():
    from modelrunner.lora import LORA_DIST, MANAGER_GROUP
    from modelrunner.plugins import feature_class, get_plugins
    from modelrunner_lora import LoRAManager, TorchLoRAKernel

    info = get_plugins().infos["lora"]
    assert (info.distribution, info.provides) == ("modelrunner-lora", {"lora_kernels": ["torch"]})
    assert get_plugins().lora_kernel_class("torch") is TorchLoRAKernel
    assert feature_class(MANAGER_GROUP, "manager", LORA_DIST, "enable_lora") is LoRAManager


def test_without_it_enable_lora_says_what_to_install(monkeypatch, tiny_llama_dir):
    from modelrunner import LLM, ModelRunnerError

    hide_distribution(monkeypatch, "modelrunner-lora")
    with pytest.raises(ModelRunnerError, match=r"^enable_lora needs the modelrunner-lora distribution: "
                                               r"pip install modelrunner-lora$"):
        LLM(str(tiny_llama_dir), dtype="float32", device="cpu", enable_lora=True, compile=False,
            kv_cache_memory=4 << 20)
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", compile=False, kv_cache_memory=4 << 20)
    assert llm.generate("Hello")[0].outputs[0].token_ids
    llm.shutdown()
