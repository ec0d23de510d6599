"""``dtype="auto"`` on a CPU: float32 without native bfloat16; with it, the rule over the measured dense
matmul times of both dtypes, measured once and kept in the cache directory; the override; ``stats()``."""

from __future__ import annotations

import json

import pytest
import torch

from modelrunner import cpu_dtype
from modelrunner.cpu_dtype import ENV, AutoDtype, cpu_auto_dtype, decide


def _times(f32_decode, f32_batch, bf16_decode, bf16_batch):
    return {"float32": {"decode": f32_decode, "batch": f32_batch},
            "bfloat16": {"decode": bf16_decode, "batch": bf16_batch}}


def test_the_rule_takes_bfloat16_only_where_it_is_faster_for_prompts_and_not_slower_to_decode():
    dtype, words = decide(_times(56e-6, 1927e-6, 40e-6, 590e-6))
    assert dtype is torch.bfloat16 and "3.27x float32's speed at 256 rows" in words
    # torch's plain F.linear on an AMX Xeon at two threads: 3.3x faster at 256 rows, 1.8x slower at one.
    assert decide(_times(56.1e-6, 1927e-6, 103.3e-6, 590.6e-6))[0] is torch.float32
    assert decide(_times(56e-6, 1000e-6, 50e-6, 900e-6))[0] is torch.float32  # 1.11x: not worth a dtype


def test_the_override_replaces_the_measurement_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv(ENV, "bfloat16")
    assert cpu_auto_dtype() == AutoDtype(torch.bfloat16, f"${ENV}=bfloat16")
    monkeypatch.setenv(ENV, "fp16")
    with pytest.raises(ValueError, match=rf"\${ENV}='fp16': expected float32 or bfloat16"):
        cpu_auto_dtype()


def test_a_cpu_without_native_bfloat16_runs_float32_unmeasured(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(cpu_dtype, "native_bf16_flags", lambda: ())
    choice = cpu_auto_dtype(cache_dir=tmp_path)
    assert choice.dtype is torch.float32 and "no native bfloat16" in choice.why
    assert not (tmp_path / "kernels.json").exists()


def test_with_native_bfloat16_the_choice_is_measured_here_once_and_read_back(monkeypatch, tmp_path):
    """The flags are the only thing faked: the timings are this CPU's own (on one without native
    bfloat16, torch emulates it and float32 wins)."""
    from transformers import LlamaConfig

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(cpu_dtype, "native_bf16_flags", lambda: ("amx_bf16",))
    config = LlamaConfig(hidden_size=256, intermediate_size=512)
    cpu_dtype._measured.cache_clear()
    first = cpu_auto_dtype(config, tmp_path)
    assert first.dtype in (torch.float32, torch.bfloat16)
    assert first.why.startswith("amx_bf16, measured on a 512x256 weight: bfloat16 matmuls ")
    stored = [v for space in json.loads((tmp_path / "kernels.json").read_text()).values() for k, v in space.items()
              if k == "auto-dtype:512x256"]
    assert stored == [f"{str(first.dtype).removeprefix('torch.')};{first.why}"]
    cpu_dtype._measured.cache_clear()
    monkeypatch.setattr(cpu_dtype, "_measure", lambda *a: pytest.fail("measured again instead of reading the cache"))
    assert cpu_auto_dtype(config, tmp_path) == first
    cpu_dtype._measured.cache_clear()


def test_stats_say_what_runs_and_why(tiny_llama_dir, monkeypatch):
    from modelrunner.runner import ModelRunner

    runner = ModelRunner({"model": str(tiny_llama_dir), "kv_cache_memory": 1 << 24})
    runner.load_model()
    assert runner.stats()["dtype"] == {"asked": "auto", "runs": "float32", "why": f"${ENV}=float32"}
    monkeypatch.setenv(ENV, "bfloat16")
    runner = ModelRunner({"model": str(tiny_llama_dir), "kv_cache_memory": 1 << 24})
    runner.load_model()
    assert runner.stats()["dtype"] == {"asked": "auto", "runs": "bfloat16", "why": f"${ENV}=bfloat16"}
    assert {t.dtype for t in runner.kv_caches} == {torch.bfloat16}
    runner = ModelRunner({"model": str(tiny_llama_dir), "dtype": "float32", "kv_cache_memory": 1 << 24})
    runner.load_model()
    assert runner.stats()["dtype"] == {"asked": "float32", "runs": "float32", "why": "asked for"}
