"""PEFT adapters saved with peft's own ``save_pretrained`` on the tiny Llama, for the LoRA tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from peft_adapters import save_peft_adapter


@pytest.fixture(scope="session")
def peft_adapters(tiny_llama_dir, tmp_path_factory) -> list[Path]:
    """Two random rank-8 adapters on all seven projections of the tiny Llama."""
    root = tmp_path_factory.mktemp("peft")
    return [save_peft_adapter(tiny_llama_dir, root / f"adapter{i}", seed=i + 1) for i in range(2)]


@pytest.fixture(scope="session")
def lora_llm(tiny_llama_dir):
    """The tiny Llama with LoRA on: two slots, two adapters kept read, rank up to 8."""
    from modelrunner import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_cpu_loras=2)
    yield llm
    llm.shutdown()
