"""Config validation: each bad field gets a message naming it; the article's flat dict works."""

from __future__ import annotations

import pytest
import torch

from modelrunner import RunnerConfig
from modelrunner.runner import resolve_dtype


def test_article_dict_is_accepted():
    cfg = RunnerConfig.from_dict({
        "model": "/models/llama", "dtype": "float16", "compile": True, "compile_backend": "inductor",
        "compile_mode": "max-autotune", "compile_cache_dir": "/tmp/cc", "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2, "trust_remote_code": False, "gpu_memory_utilization": 0.9, "device": 0,
    })
    assert cfg.model.model == "/models/llama" and cfg.model.dtype == "float16"
    assert cfg.compile.enabled and cfg.compile.backend == "inductor" and cfg.compile.mode == "max-autotune"
    assert cfg.compile.cache_dir == "/tmp/cc" and cfg.compile.backend_name == "inductor"
    assert cfg.parallel.world_size == 16
    assert cfg.cache.gpu_memory_utilization == 0.9 and cfg.device == 0


def test_defaults_are_safe():
    cfg = RunnerConfig()
    assert cfg.model.model == "smollm2" and cfg.model.trust_remote_code is False
    assert cfg.compile.backend_name == "eager"
    assert cfg.cache.kv_allocator == "paged" and cfg.scheduler.max_num_seqs >= 256


@pytest.mark.parametrize("key, value, message", [
    ("dtype", "fp8", "dtype must be one of auto, float32, float16, bfloat16; got 'fp8'"),
    ("compile", "yes", "compile must be True or False, got 'yes'"),
    ("compile_backend", "", "backend must be a non-empty string"),
    ("compile_mode", 3, "mode must be a non-empty string, got 3"),
    ("compile_cache_dir", 3, "compile_cache_dir must be a path string or None, got 3"),
    ("tensor_parallel_size", 0, "tensor_parallel_size must be a positive integer, got 0"),
    ("pipeline_parallel_size", -2, "pipeline_parallel_size must be a positive integer, got -2"),
    ("trust_remote_code", "no", "trust_remote_code must be True or False, got 'no'"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be a number in (0, 1], got 1.5"),
    ("gpu_memory_utilization", 0, "gpu_memory_utilization must be a number in (0, 1], got 0"),
    ("device", "tpu", "device must be 'auto', 'cpu', 'cuda', 'cuda:N' or a GPU index, got 'tpu'"),
    ("model", "", "model must be a non-empty string"),
    ("max_model_len", 1.5, "max_model_len must be a positive integer, got 1.5"),
    ("block_size", 0, "block_size must be a positive integer, got 0"),
    ("kv_cache_memory", -1, "kv_cache_memory must be a positive integer, got -1"),
    ("max_num_seqs", True, "max_num_seqs must be a positive integer, got True"),
    ("enable_prefix_caching", 1, "enable_prefix_caching must be True or False, got 1"),
])
def test_each_invalid_field_names_itself(key, value, message):
    with pytest.raises(ValueError) as info:
        RunnerConfig.from_dict({key: value})
    assert message in str(info.value)


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown config key 'tensor_paralel_size'; did you mean 'tensor_parallel_size'\?"):
        RunnerConfig.from_dict({"tensor_paralel_size": 2})
    with pytest.raises(ValueError, match="unknown config key 'zzz'.*known keys: .*dtype"):
        RunnerConfig.from_dict({"zzz": 1})


def test_configs_are_frozen():
    cfg = RunnerConfig()
    with pytest.raises(AttributeError):
        cfg.device = "cpu"  # type: ignore[misc]


class _Cfg:
    def __init__(self, dtype):
        self.dtype = dtype


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoints_on_gpu():
    assert resolve_dtype("auto", _Cfg(torch.bfloat16), torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", _Cfg(torch.bfloat16), torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype("auto", _Cfg("float16"), torch.device("cuda")) is torch.float16
    assert resolve_dtype("bfloat16", _Cfg(torch.float32), torch.device("cpu")) is torch.bfloat16
