"""Fixtures for the parallel tests: tiny checkpoints, a per-test watchdog, a check for leftover processes.

Every test here starts real processes (gloo on the CPU); the watchdog turns a hang into a failure
with every thread's stack instead of a stuck CI job.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

TEST_TIMEOUT_S = 240
"""Hard limit for any one test here (process start-up dominates: ~5-10 s per worker on 2 cores)."""

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def watchdog():
    """Dump every thread's stack and exit if a test runs past :data:`TEST_TIMEOUT_S`."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


def children() -> list[psutil.Process]:
    """This process's live descendants, except multiprocessing's resource tracker (one per parent
    process, shared by every spawn, it exits with the parent)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "multiprocessing.resource_tracker" not in " ".join(
                    child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_for_no_children(timeout: float = 10.0) -> list[psutil.Process]:
    """Wait until no descendant is left; those still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _randomize(model) -> None:
    # Weights far from HF's tiny init, so logits are well separated and greedy choices are stable.
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))


def save_tiny_llama(path: Path, tokenizer, num_layers: int = 2, tie: bool = False) -> Path:
    """A random Llama (hidden 64, 4 heads, 2 kv heads, vocab 256) with ``tokenizer``, saved to ``path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                         tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    config.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(config).eval()
    _randomize(model)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A 2-layer random Llama checkpoint with SmolLM2's tokenizer."""
    return save_tiny_llama(tmp_path_factory.mktemp("par-llama"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A 2-layer random Mixtral (4 experts, top 2) with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, num_local_experts=4,
                           num_experts_per_tok=2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    config.architectures = ["MixtralForCausalLM"]
    model = AutoModelForCausalLM.from_config(config).eval()
    _randomize(model)
    path = tmp_path_factory.mktemp("par-mixtral")
    model.save_pretrained(str(path))
    smollm2_tokenizer.save_pretrained(str(path))
    return path
