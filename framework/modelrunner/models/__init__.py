"""What model adapters share: the pre-norm decoder, pipeline-stage helpers, running a step, and the
protocols adapters rely on in each other's models (building and loading one: :mod:`modelrunner.loading`).

No adapter imports another adapter; whatever two of them need lives here.
"""

from .decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    head_dim_of,
    sliding_windows_of,
    tp_args,
)
from .forward import run_stage
from .protocols import TextModel
from .stages import StageMissingLayer, StageWeights, check_built_for

__all__ = [
    "DecoderAttention",
    "DecoderForCausalLM",
    "DecoderLayer",
    "DecoderModel",
    "GatedMLP",
    "StageMissingLayer",
    "StageWeights",
    "TextModel",
    "check_built_for",
    "head_dim_of",
    "run_stage",
    "sliding_windows_of",
    "tp_args",
]
