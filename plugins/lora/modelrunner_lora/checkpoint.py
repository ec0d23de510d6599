"""Reading a PEFT LoRA checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``), refusing
what the kernel does not run with a message naming the file and the field."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import attrs
import torch

from modelrunner.api import ModelRunnerError

CONFIG_FILE = "adapter_config.json"
"""The PEFT adapter's configuration file."""
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
"""The weight files tried, in order (``.bin`` is read with ``torch.load(weights_only=True)``)."""
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections a LoRA may target."""
REFUSED_FIELDS = {
    "use_dora": "DoRA (use_dora=true) is not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "rank_pattern": "rank_pattern (per-module ranks) is not supported",
    "alpha_pattern": "alpha_pattern (per-module alphas) is not supported",
}
"""adapter_config.json fields that must be empty/false, and why."""
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class LoRAError(ModelRunnerError, ValueError):
    """A LoRA adapter that cannot be used: the message names its file and what is wrong."""


@attrs.frozen
class LoRAWeights:
    """One projection's low-rank update ``W + scaling · B A``."""

    lora_a: torch.Tensor
    """``[rank, in_features]``."""
    lora_b: torch.Tensor
    """``[out_features, rank]``."""


@attrs.frozen
class PeftAdapter:
    """A PEFT LoRA checkpoint as read from disk (CPU tensors, the checkpoint's dtype)."""

    path: Path
    """The adapter directory."""
    rank: int
    """``r``."""
    scaling: float
    """``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``."""
    modules: dict[str, LoRAWeights]
    """Module name in the base model (``model.layers.0.self_attn.q_proj``) → its A and B."""
    base_model: str | None = None
    """``base_model_name_or_path`` of the config (informational)."""


def read_peft_adapter(path: str | Path, max_rank: int) -> PeftAdapter:
    """Read and check a PEFT LoRA directory.

    :raises LoRAError: a missing or unreadable file, a field the kernel does not support (DoRA,
        ``modules_to_save``, ``rank_pattern``, ``bias`` other than ``none``), a rank above ``max_rank``,
        a tensor that is not a LoRA A/B of a supported projection, or inconsistent shapes.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter {str(path)!r}: no such directory (expected a PEFT checkpoint folder "
                        f"with {CONFIG_FILE} and {WEIGHT_FILES[0]})")
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise LoRAError(f"LoRA adapter {str(folder)!r}: {CONFIG_FILE} is missing")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{config_file}: cannot be read as JSON ({e})") from e
    if not isinstance(config, dict):
        raise LoRAError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    rank, scaling = _check_config(config, config_file, max_rank)
    tensors, weight_file = _read_tensors(folder)
    modules = _pair(tensors, weight_file, rank)
    if not modules:
        raise LoRAError(f"{weight_file}: holds no lora_A/lora_B weights")
    return PeftAdapter(path=folder, rank=rank, scaling=scaling, modules=modules,
                       base_model=config.get("base_model_name_or_path"))


def _check_config(config: dict[str, Any], where: Path, max_rank: int) -> tuple[int, float]:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    for field, why in REFUSED_FIELDS.items():
        if config.get(field):
            raise LoRAError(f"{where}: {why} (field {field!r} is {config[field]!r})")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise LoRAError(f"{where}: bias={bias!r} is not supported (field 'bias' must be 'none')")
    if config.get("fan_in_fan_out"):
        raise LoRAError(f"{where}: fan_in_fan_out=true (Conv1D-style weights) is not supported")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise LoRAError(f"{where}: field 'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"{where}: rank r={rank} exceeds max_lora_rank={max_rank}; raise max_lora_rank")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAError(f"{where}: field 'lora_alpha' must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _read_tensors(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file)), file
            return torch.load(str(file), map_location="cpu", weights_only=True), file
        except Exception as e:  # noqa: BLE001 - safetensors/pickle raise many kinds for a bad file
            raise LoRAError(f"{file}: cannot be read ({type(e).__name__}: {e})") from e
    raise LoRAError(f"LoRA adapter {str(folder)!r}: no weight file ({' or '.join(WEIGHT_FILES)})")


def _pair(tensors: dict[str, Any], where: Path, rank: int) -> dict[str, LoRAWeights]:
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"{where}: tensor {key!r} is not a LoRA A/B weight of a linear projection "
                            "(embedding and LM-head LoRAs, DoRA magnitudes and saved modules are not supported)")
        module = match["module"]
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in TARGETS:
            raise LoRAError(f"{where}: target module {leaf!r} ({key}) is not supported; LoRA targets one of "
                            f"{', '.join(TARGETS)}")
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or not tensor.is_floating_point():
            raise LoRAError(f"{where}: {key} must be a 2-D float tensor")
        found.setdefault(module, {})[match["ab"]] = tensor
    modules = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAError(f"{where}: {module} has no {missing} weight")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"{where}: {module}'s lora_A {list(a.shape)} / lora_B {list(b.shape)} do not have "
                            f"the config's rank r={rank}")
        modules[module] = LoRAWeights(a, b)
    return modules
