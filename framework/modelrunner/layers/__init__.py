"""Building blocks that model adapters compose: paged attention, RoPE, RMSNorm, parallel linear layers.

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that copies this
tensor-parallel rank's slice of a full checkpoint tensor (see :func:`modelrunner.weights.load_weights`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .activation import SiluAndMul
from .attention import Attention
from .attention_backend import AttentionBackend, AttentionLayer, GraphInputs
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from .norm import RMSNorm
from .rotary import RotaryEmbedding, rope_parameters
from .sdpa_attention import TorchSDPABackend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionLayer",
    "GraphInputs",
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "TorchSDPABackend",
    "VocabParallelEmbedding",
    "default_weight_loader",
    "rope_parameters",
]


def select_attention_backend(device: torch.device | str = "cpu", name: str | None = None) -> Any:
    """Deprecated: a load hook receives the selected backend as its ``attention_backend`` argument.

    Kept for adapters written against plugin API 0.x; picks from the process's default plugins.
    """
    warnings.warn("modelrunner.layers.select_attention_backend is deprecated: accept the `attention_backend` "
                  "argument of the load hook instead (see CHANGELOG.md)", DeprecationWarning, stacklevel=2)
    from ..plugins import get_plugins

    return get_plugins().attention_backend(device, name)


def attention_backends(device: torch.device | str | None = None) -> list[str]:
    """Deprecated: use ``Plugins.attention_backends(device)`` (``modelrunner.plugins.get_plugins()``)."""
    warnings.warn("modelrunner.layers.attention_backends is deprecated: use "
                  "modelrunner.plugins.get_plugins().attention_backends(device)", DeprecationWarning, stacklevel=2)
    from ..plugins import get_plugins

    return get_plugins().attention_backends(device)
