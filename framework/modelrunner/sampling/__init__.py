"""Sampling: per-request parameters, logits processors (a plugin kind) and their built-ins."""

from .builtin import BUILTIN_PROCESSORS, BuiltinProcessor
from .logits_processor import LogitsProcessor, LogitsRow, ProcessorContext, banned_mask, token_counts
from .params import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams

__all__ = [
    "BUILTIN_PROCESSORS",
    "BuiltinProcessor",
    "LogitsProcessor",
    "LogitsRow",
    "MAX_LOGPROBS",
    "ProcessorContext",
    "SAMPLING_EPS",
    "SamplingParams",
    "banned_mask",
    "token_counts",
]
