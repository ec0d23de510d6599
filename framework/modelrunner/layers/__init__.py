"""Building blocks that model adapters compose: paged attention, RoPE, RMSNorm, parallel linear layers.

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that copies this
tensor-parallel rank's slice of a full checkpoint tensor (see :func:`modelrunner.loading.weights.load_weights`).
"""

from __future__ import annotations

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
