"""What model adapters share: the pre-norm decoder, pipeline-stage helpers, building and loading a
model, running a step, and the protocols adapters rely on in each other's models.

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
from .loader import ModelLoader
from .loading import build_and_load, kv_cache_spec_for, load_tokenizer, loaded_for
from .protocols import TextModel
from .stages import StageMissingLayer, StageWeights, check_built_for

__all__ = [
    "DecoderAttention",
    "DecoderForCausalLM",
    "DecoderLayer",
    "DecoderModel",
    "GatedMLP",
    "ModelLoader",
    "StageMissingLayer",
    "StageWeights",
    "TextModel",
    "build_and_load",
    "check_built_for",
    "head_dim_of",
    "kv_cache_spec_for",
    "load_tokenizer",
    "loaded_for",
    "run_stage",
    "sliding_windows_of",
    "tp_args",
]
