"""Random PEFT LoRA adapters saved by peft itself, for the LoRA tests (offline and server)."""

from __future__ import annotations

from pathlib import Path

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
