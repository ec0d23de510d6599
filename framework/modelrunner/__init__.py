"""modelrunner: a plugin-oriented execution core for large language models.

Everything public is importable from here; submodules are implementation detail.
"""

from __future__ import annotations

import logging
from typing import Any

# A library logs; the application decides what is shown (the CLI shows it with MODELRUNNER_DEBUG=1).
logging.getLogger("modelrunner").addHandler(logging.NullHandler())

from .config import CacheConfig, CompileConfig, ModelConfig, ParallelConfig, RunnerConfig, SchedulerConfig
from .errors import (ModelRunnerError, ModelSourceError, PluginConflictError, PluginError, StructuredOutputError,
                     UnknownNameError)
from .forward_batch import ForwardBatch
from .hookspecs import PLUGIN_API_VERSION, hookimpl
from .loaded_model import LoadedModel

__all__ = [
    "PLUGIN_API_VERSION",
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "ModelRunner",
    "RunnerConfig",
    "ModelConfig",
    "CacheConfig",
    "ParallelConfig",
    "CompileConfig",
    "SchedulerConfig",
    "ForwardBatch",
    "LoadedModel",
    "hookimpl",
    "ModelRunnerError",
    "ModelSourceError",
    "PluginError",
    "UnknownNameError",
    "PluginConflictError",
    "StructuredOutputError",
    "LLMEngine",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchParams",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
]

_LAZY = {
    "LLM": ("modelrunner.llm", "LLM"),
    "LoRARequest": ("modelrunner.lora.request", "LoRARequest"),
    "SamplingParams": ("modelrunner.sampling.params", "SamplingParams"),
    "StructuredOutputsParams": ("modelrunner.sampling.structured", "StructuredOutputsParams"),
    "GuidedDecodingParams": ("modelrunner.sampling.structured", "GuidedDecodingParams"),
    "ModelRunner": ("modelrunner.llm", "ModelRunner"),
    "LLMEngine": ("modelrunner.engine.llm_engine", "LLMEngine"),
    "RequestOutput": ("modelrunner.engine.outputs", "RequestOutput"),
    "CompletionOutput": ("modelrunner.engine.outputs", "CompletionOutput"),
    "Logprob": ("modelrunner.engine.outputs", "Logprob"),
    "BeamSearchParams": ("modelrunner.engine.beam_search", "BeamSearchParams"),
    "PoolingParams": ("modelrunner.pooling.params", "PoolingParams"),
    "PoolingRequestOutput": ("modelrunner.pooling.outputs", "PoolingRequestOutput"),
    "EmbeddingRequestOutput": ("modelrunner.pooling.outputs", "EmbeddingRequestOutput"),
}


def __getattr__(name: str) -> Any:
    # torch-heavy pieces load on first use, so `import modelrunner` stays cheap for plugins.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'modelrunner' has no attribute {name!r}")
