"""Sampling: per-request parameters (structured-output constraints among them), logits processors (a
plugin kind) and their built-ins."""

from .builtin import BUILTIN_PROCESSORS, BuiltinProcessor
from .logits_processor import LogitsProcessor, LogitsRow, ProcessorContext, banned_mask, token_counts
from .params import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams
from .structured import GuidedDecodingParams, StructuredOutputsParams

__all__ = [
    "BUILTIN_PROCESSORS",
    "BuiltinProcessor",
    "GuidedDecodingParams",
    "LogitsProcessor",
    "LogitsRow",
    "MAX_LOGPROBS",
    "ProcessorContext",
    "SAMPLING_EPS",
    "SamplingParams",
    "StructuredOutputsParams",
    "banned_mask",
    "token_counts",
]
