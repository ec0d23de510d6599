"""Fixtures for the multimodal adapter: one tiny LLaVA checkpoint per session, its reference, an LLM."""

from __future__ import annotations

import pytest

from .checkpoint import save_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory, smollm2_dir):
    """``(path, transformers model, processor)`` of the tiny random LLaVA."""
    path = tmp_path_factory.mktemp("tiny-llava")
    model, processor = save_tiny_llava(path, smollm2_dir)
    return path, model, processor


@pytest.fixture(scope="session")
def llava_llm(tiny_llava):
    """An :class:`~modelrunner.LLM` on the tiny LLaVA: float32, 4-token blocks, prompts prefilled in
    chunks of at most 8 tokens (so image tokens straddle chunks)."""
    from modelrunner.llm import LLM

    return LLM(model=str(tiny_llava[0]), dtype="float32", block_size=4, max_num_batched_tokens=8,
               max_model_len=256, kv_cache_memory=4 << 20)
