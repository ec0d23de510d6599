"""vLLM's module name for the per-request parameters: ``from modelrunner.sampling_params import
SamplingParams, StructuredOutputsParams`` works as ``from vllm.sampling_params import ...`` does."""

from .sampling.params import SamplingParams
from .sampling.structured import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "SamplingParams", "StructuredOutputsParams"]
