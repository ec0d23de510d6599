"""The ``modelrunner`` console script, run as a user would: a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def modelrunner(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    exe = shutil.which("modelrunner", path=os.path.dirname(sys.executable))
    assert exe, "the modelrunner console script is not installed next to this python"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_generate_chat_streams_the_answer_and_prints_stats():
    result = modelrunner("generate", "--chat", "--stats", "--max-tokens", "16", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."
    assert "used_blocks" in result.stderr and "fragmentation" in result.stderr and "prefix_hit_rate" in result.stderr


def test_generate_plain_prompt_on_a_local_checkpoint(tiny_llama_dir):
    result = modelrunner("generate", "--model", str(tiny_llama_dir), "--max-tokens", "5", "--set",
                         "kv_allocator=contiguous", "Hello")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n") and len(result.stdout.strip()) > 0


def test_missing_model_is_a_one_line_error():
    result = modelrunner("generate", "--model", "/no/such/model", "hi")
    assert result.returncode == 2
    assert result.stderr.strip() == ("modelrunner: error: model '/no/such/model': no such file or directory; pass a "
                                     "Hugging Face checkpoint directory, a .gguf file, or one of: smollm2")


def test_hub_id_is_refused_without_network():
    result = modelrunner("generate", "--model", "meta-llama/Llama-3.1-8B", "hi", timeout=60)
    assert result.returncode == 2 and "never downloads" in result.stderr and "Traceback" not in result.stderr


def test_bad_sampling_value_and_bad_config_key_are_clear_errors():
    bad_temp = modelrunner("generate", "--temperature", "-1", "hi")
    assert bad_temp.returncode == 2 and "temperature" in bad_temp.stderr and "Traceback" not in bad_temp.stderr
    bad_key = modelrunner("generate", "--set", "kv_alocator=paged", "hi")
    assert bad_key.returncode == 2 and "did you mean 'kv_allocator'" in bad_key.stderr
