"""The plugin API: everything a plugin may import from the kernel, in one module.

A plugin (a model adapter, a KV-cache allocator, a compile or attention backend, a quantization
method or matmul kernel, a grammar backend, a tool parser, a proposer, a LoRA kernel, an executor, a
pooling method, a logits processor) imports from here and nowhere else in ``modelrunner``; every
other module is the kernel's implementation and may change without notice. The in-repo adapters and
plugins use only this module (a test holds them to it), which is how we know it is enough.
``CHANGELOG.md`` records every change to what is here, with the one-line migration.

The other public entry points are not for plugins: ``modelrunner`` itself (the offline API: ``LLM``,
``SamplingParams`` …) and ``modelrunner.native_build`` (compiling a plugin's C++ from its ``setup.py``).
A plugin's tests use the plugin kit, the separate ``modelrunner-kit`` distribution (``modelrunner_kit``:
the conformance suites, ``modelrunner check`` and ``new-plugin``, test helpers); the kernel never
imports it. ``ModelRunner`` here is the kernel's runner (one process's model, what an executor drives);
``modelrunner.ModelRunner`` is the same with an engine built on first use.
"""

from __future__ import annotations

from .config import RunnerConfig
from .cpu_dtype import native_bf16
from .defaults import transformers_adapter
from . import wire
from .distributed import STAGE_INPUTS, STAGE_OUTPUTS, LaunchInfo, collective_timeout
from .errors import ModelRunnerError, PluginError, StructuredOutputError, UnknownNameError, did_you_mean
from .executor import UniprocExecutor, WorkerFailedError, create_executor
from .executor_base import Executor
from .forward_batch import HIDDEN_STATES, ForwardBatch, ForwardOutput
from .hookspecs import PLUGIN_API_VERSION, hookimpl
from .kv_cache.allocator import BlockAllocator, BlockCopy, KVCacheError, KVCacheStats
from .kv_cache.paged import PagedBlockAllocator
from .layers import (Attention, AttentionBackend, ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                     ParallelLMHead, QKVParallelLinear, ReplicatedLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                     SiluAndMul, TorchSDPABackend, VocabParallelEmbedding)
from .layers.attention_backend import GraphInputs
from .layers.cpu_ops import fused, ops
from .layers.dense import PATHS as DENSE_PATHS
from .layers.dense import onednn_in_compiled_graphs, onednn_linear, plan_summary, prepack_weights
from .layers.fused_moe import FusedMoE, expert_tensor_name
from .layers.moe_router import check_top_k
from .layers.sdpa_attention import SDPAMetadata, store_kv
from .loaded_model import LoadedModel
from .lora import LoRAKernel, LoRAMapping, LoRARequest, reference_apply
from .loading import (CheckpointError, ModelLoader, build_and_load, iter_weights, load_weights, loaded_for,
                      resolve_source)
from .models import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP, TextModel, check_built_for, run_stage
from .native import NativeBuildError, cpu_flags, load_library
from .parallel_state import ParallelState
from .plugins import Plugins, get_plugins
from .pooling import PoolingMethod
from .quantization import (GGMLBlocks, MatmulKernel, QuantizationMethod, QuantizedWeight, WeightFormat, dequantize_planar,
                           quantizable_layers, quantize_planar)
from .quantization.blocks import FLOAT_TYPES as GGML_FLOAT_TYPES
from .quantization.blocks import ggml_type_name
from .quantization.ggml_formats import PLANAR_FORMS, PlanarForm, block_bytes, dequantize_blocks, to_planar
from .quantization.matmul import PLANAR
from .quantization.planar_layout import pack_int4, unpack_int4
from .registry import Registry, split_choice
from .runner import ModelRunner, resolve_device
from .timing_cache import DECODE_ROWS, TIMING_ROWS, TimingCache, time_candidates
from .sampling import LogitsProcessor, LogitsRow, banned_mask
from .spec_decode import ProposalRequest, Proposer, ProposerContext, SpecCounters
from .plugin_timeout import PluginTimeoutError, timeout_from_env
from .structured_output import (MATCHES_NOTHING, GrammarBackend, GrammarMatcher, GrammarSpec, apply_bitmask,
                                bitmask_from_allowed, decoded_vocabulary)
from .tool_parser import ParsedOutput, ToolCall, ToolParser, json_values

__all__ = [
    # Declaring a plugin
    "PLUGIN_API_VERSION", "hookimpl", "Registry", "Plugins",
    # What hooks receive and return
    "RunnerConfig", "ForwardBatch", "ForwardOutput", "LoadedModel", "ParallelState",
    # Errors a plugin raises or catches
    "ModelRunnerError", "PluginError", "UnknownNameError", "StructuredOutputError", "CheckpointError",
    "KVCacheError", "NativeBuildError", "WorkerFailedError", "did_you_mean",
    # The base class of each class kind
    "AttentionBackend", "LogitsProcessor", "QuantizationMethod", "MatmulKernel", "GrammarBackend", "ToolParser",
    "Proposer", "LoRAKernel", "Executor", "PoolingMethod", "BlockAllocator",
    # Model building blocks (adapters)
    "Attention", "RMSNorm", "RotaryEmbedding", "SiluAndMul", "LinearBase", "ColumnParallelLinear",
    "RowParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear", "ReplicatedLinear",
    "VocabParallelEmbedding", "ParallelLMHead", "FusedMoE", "expert_tensor_name", "check_top_k",
    "DecoderAttention", "DecoderForCausalLM", "DecoderLayer", "GatedMLP", "TextModel", "ModelLoader",
    "build_and_load", "check_built_for", "loaded_for", "run_stage", "iter_weights", "load_weights",
    "transformers_adapter",
    # Attention backends and KV-cache allocators
    "TorchSDPABackend", "SDPAMetadata", "GraphInputs", "store_kv", "PagedBlockAllocator", "BlockCopy",
    "KVCacheStats",
    # Compile backends: the kernel's fused CPU ops and dense weight plans
    "ops", "fused", "DENSE_PATHS", "onednn_linear", "onednn_in_compiled_graphs", "plan_summary", "prepack_weights",
    # Quantization methods and matmul kernels (the methods themselves: the modelrunner-quantization distribution)
    "QuantizedWeight", "WeightFormat", "GGMLBlocks", "quantizable_layers", "PLANAR", "quantize_planar",
    "dequantize_planar", "pack_int4", "unpack_int4", "GGML_FLOAT_TYPES", "ggml_type_name", "PLANAR_FORMS", "PlanarForm",
    "block_bytes", "to_planar", "dequantize_blocks", "native_bf16", "cpu_flags", "load_library",
    # Timing candidates on this machine, once, cached (kernel selection)
    "TimingCache", "time_candidates", "DECODE_ROWS", "TIMING_ROWS", "get_plugins", "split_choice",
    # Logits processors, grammar backends, tool parsers, proposers, LoRA kernels
    "LogitsRow", "banned_mask", "GrammarMatcher", "GrammarSpec", "MATCHES_NOTHING", "apply_bitmask",
    "bitmask_from_allowed", "decoded_vocabulary", "ParsedOutput", "ToolCall", "json_values", "ProposalRequest", "ProposerContext",
    "SpecCounters", "PluginTimeoutError", "timeout_from_env",
    "LoRAMapping", "LoRARequest", "reference_apply",
    # Executors (the multi-process ones: the modelrunner-executor-mp distribution) and what crosses processes
    "UniprocExecutor", "create_executor", "ModelRunner", "resolve_device", "resolve_source", "LaunchInfo",
    "collective_timeout", "STAGE_INPUTS", "STAGE_OUTPUTS", "HIDDEN_STATES", "wire",
]
