"""Building blocks that model adapters compose: paged attention, RoPE, RMSNorm, parallel linear layers.

Every parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that copies this
tensor-parallel rank's slice of a full checkpoint tensor (see :func:`modelrunner.weights.load_weights`).
"""

from .activation import SiluAndMul
from .attention import (
    Attention,
    AttentionBackend,
    attention_backends,
    register_attention_backend,
    select_attention_backend,
)
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
from .sampler import Sampler, SamplingMetadata

__all__ = [
    "Attention",
    "AttentionBackend",
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "Sampler",
    "SamplingMetadata",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "attention_backends",
    "default_weight_loader",
    "register_attention_backend",
    "rope_parameters",
    "select_attention_backend",
]
