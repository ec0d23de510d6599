"""Random PEFT LoRA adapters saved by peft itself, for the LoRA tests (offline and server)."""

from __future__ import annotations

from pathlib import Path

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_peft_adapter(base_dir: Path, path: Path, seed: int, rank: int = 8, alpha: int = 16,
                      targets: list[str] | None = None, **config) -> Path:
    """A random LoRA (non-zero B, so a missing delta shows) on ``targets`` of the causal LM at
    ``base_dir``, saved by peft."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    random_peft_lora(base, path, seed, rank, alpha, targets, **config)
    return path


def random_peft_lora(base, path: Path, seed: int, rank: int = 8, alpha: int = 16,
                     targets: list[str] | str | None = None, **config):
    """``base`` (a transformers model of any class) wrapped by peft with a random LoRA (non-zero B) on
    ``targets`` (names or peft's regex), saved to ``path``; the peft model, for reference outputs."""
    import torch
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or SEVEN, init_lora_weights=False, **config)
    torch.manual_seed(seed)
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(path))
    return model
