"""Will the model fit? Its weights' bytes estimated from its config, checked before it is built.

A config with an absurd size (a vocabulary of 10⁹, a million layers) would otherwise be allocated:
minutes of work, then a ``MemoryError`` traceback or the OOM killer. :func:`check_model_fits` runs
in the kernel's shared loading path (every adapter, installed or third-party, gets it) and refuses
such a model at once, naming the estimate, the memory available and the config fields behind it.

The estimate is a lower bound: embeddings, LM head and the decoder layers' linear weights (norms,
biases and vision towers left out; a two-matrix MLP unless the model family is known to be gated),
so it never refuses a model that would have fit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import torch

from .errors import ModelRunnerError

SKIP_ENV = "MODELRUNNER_SKIP_MEMORY_CHECK"
"""Set to ``1`` to load a model even when its estimated weights exceed the available memory."""
QUANTIZED_BYTES_PER_PARAM = 0.5
"""Bytes per weight assumed for a quantized checkpoint (4 bits: the smallest common format)."""
GATED_MLP_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi3", "olmo", "olmo2", "granite", "granitemoe", "cohere", "internlm2", "deepseek_v2", "deepseek_v3",
    "smollm3", "exaone"})
"""Model families whose MLP has three matrices (gate, up, down); others are counted with two."""


class ModelTooLargeError(ModelRunnerError):
    """The model's weights, estimated from its config, exceed the memory available to hold them."""


@attrs.frozen
class SizeEstimate:
    """A lower bound on a model's weight bytes, with the config fields each part comes from."""

    parameters: int
    """Weights counted."""
    bytes_per_parameter: float
    """From the dtype (or the quantization)."""
    parts: tuple[tuple[str, int], ...]
    """``(description naming the config fields, parameters)`` per part, largest first."""

    @property
    def bytes(self) -> int:
        """Estimated bytes of the weights."""
        return int(self.parameters * self.bytes_per_parameter)


def _field(config: Any, *names: str) -> tuple[str, int] | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def estimate_weights(hf_config: Any, bytes_per_parameter: float) -> SizeEstimate | None:
    """A lower bound on the weights of the (text) model ``hf_config`` describes; None when the config
    lacks the usual fields (hidden size, layers, vocabulary)."""
    config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hidden = _field(config, "hidden_size", "n_embd", "d_model")
    layers = _field(config, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _field(config, "vocab_size")
    if hidden is None or layers is None or vocab is None:
        return None
    h = hidden[1]
    heads = _field(config, "num_attention_heads", "n_head")
    kv_heads = _field(config, "num_key_value_heads") or heads
    head_dim = _field(config, "head_dim") or (("hidden_size/num_attention_heads", h // heads[1]) if heads else None)
    intermediate = _field(config, "intermediate_size", "n_inner", "ffn_dim") or ("4*hidden_size", 4 * h)
    experts = _field(config, "num_local_experts", "num_experts", "n_routed_experts")
    expert_size = _field(config, "moe_intermediate_size") or intermediate
    shared = _field(config, "shared_expert_intermediate_size")
    mlp_matrices = 3 if getattr(config, "model_type", None) in GATED_MLP_MODEL_TYPES else 2

    tied = bool(getattr(config, "tie_word_embeddings", getattr(hf_config, "tie_word_embeddings", True)))
    embed = vocab[1] * h * (1 if tied else 2)
    embed_what = f"embeddings{'' if tied else ' and LM head'}: {vocab[0]}={vocab[1]} × {hidden[0]}={h}"
    fields = [f"{hidden[0]}={h}"]
    per_layer = 0
    if heads and head_dim:
        q = heads[1] * head_dim[1]
        kv = kv_heads[1] * head_dim[1] if kv_heads else q
        per_layer += h * (2 * q + 2 * kv)
        fields += [f"{heads[0]}={heads[1]}"] + ([f"{kv_heads[0]}={kv_heads[1]}"] if kv_heads is not heads else [])
    if experts:
        per_layer += mlp_matrices * h * (expert_size[1] * experts[1] + (shared[1] if shared else 0))
        fields += [f"{experts[0]}={experts[1]}", f"{expert_size[0]}={expert_size[1]}"]
    else:
        per_layer += mlp_matrices * h * intermediate[1]
        fields.append(f"{intermediate[0]}={intermediate[1]}")
    decoder = layers[1] * per_layer
    parts = sorted([(embed_what, embed), (f"decoder layers: {layers[0]}={layers[1]} × ({', '.join(fields)})",
                                          decoder)], key=lambda p: -p[1])
    return SizeEstimate(embed + decoder, bytes_per_parameter, tuple(parts))


def host_memory_available() -> tuple[int, str] | None:
    """Bytes this process can still allocate on the host and where that number comes from:
    ``MemAvailable`` of ``/proc/meminfo``, lowered to the cgroup's remaining limit when there is one."""
    found: list[tuple[int, str]] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        try:
            found.append((os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages"))
        except (OSError, ValueError, AttributeError):
            pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append((max(0, int(limit) - used), "the cgroup's memory.max less memory.current"))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def device_memory_available(device: torch.device) -> tuple[int, str] | None:
    """Free bytes where the weights go (the GPU's free memory, or the host's) and their source."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory of {device} (torch.cuda.mem_get_info)"
    if device.type == "cpu":
        return host_memory_available()
    return None


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def check_model_fits(source: Any, dtype: torch.dtype, device: torch.device, world_size: int = 1,
                     quantized: bool = False) -> None:
    """Refuse a model whose weights cannot fit, before anything is built.

    On a GPU each of the ``world_size`` ranks holds about ``1/world_size`` of the weights on its own
    device; on the CPU the ranks share the host, so the whole model is compared with it.

    :param source: the resolved checkpoint (its ``hf_config``).
    :param quantized: the weights are stored quantized (counted at :data:`QUANTIZED_BYTES_PER_PARAM`).
    :raises ModelTooLargeError: naming the estimate, the memory available and the config fields.
    """
    if os.environ.get(SKIP_ENV, "").strip() not in ("", "0"):
        return
    per_param = QUANTIZED_BYTES_PER_PARAM if quantized else dtype.itemsize
    estimate = estimate_weights(source.hf_config, per_param)
    if estimate is None:
        return
    available = device_memory_available(device)
    if available is None:
        return
    need = estimate.bytes // world_size if device.type == "cuda" else estimate.bytes
    free, where = available
    if need <= free:
        return
    share = f", {_gb(need)} per rank over {world_size} ranks" if need != estimate.bytes else ""
    parts = "; ".join(f"{what} ({_gb(n * per_param)})" for what, n in estimate.parts)
    storage = "quantized" if quantized else str(dtype).removeprefix("torch.")
    raise ModelTooLargeError(
        f"{getattr(source, 'path', source)}: the model's weights need at least {_gb(estimate.bytes)}{share} "
        f"({estimate.parameters:,} parameters in {storage}) but only {_gb(free)} is available on {device.type} "
        f"({where}); from config.json: {parts}. Check those fields, or use a smaller dtype or more "
        f"tensor-parallel ranks ({SKIP_ENV}=1 skips this check)")
