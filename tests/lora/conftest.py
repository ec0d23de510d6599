"""PEFT adapters saved with peft's own ``save_pretrained`` on the tiny Llama, for the LoRA tests."""

from __future__ import annotations

from pathlib import Path

import pytest

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(base_dir: Path, path: Path, seed: int, rank: int = 8, alpha: int = 16,
                      targets: list[str] | None = None, **config) -> Path:
    """A random LoRA (non-zero B, so a missing delta shows) on ``targets`` of the model at ``base_dir``,
    saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or SEVEN, init_lora_weights=False, **config)
    torch.manual_seed(seed)
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def peft_adapters(tiny_llama_dir, tmp_path_factory) -> list[Path]:
    """Two random rank-8 adapters on all seven projections of the tiny Llama."""
    root = tmp_path_factory.mktemp("peft")
    return [save_peft_adapter(tiny_llama_dir, root / f"adapter{i}", seed=i + 1) for i in range(2)]


@pytest.fixture(scope="session")
def save_adapter():
    """:func:`save_peft_adapter`, for test modules."""
    return save_peft_adapter


@pytest.fixture(scope="session")
def lora_llm(tiny_llama_dir):
    """The tiny Llama with LoRA on: two slots, two adapters kept read, rank up to 8."""
    from modelrunner import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_cpu_loras=2)
    yield llm
    llm.shutdown()
