"""Fixtures of the embedding tests: a tiny Llama (the llama adapter) and a tiny Qwen3-Embedding-style
checkpoint (``Qwen3ForCausalLM`` weights with sentence-transformers' last-token pooling and
normalisation, Matryoshka dimensions 16/32/64; no native adapter, so the generic transformers one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

EMBED_CONFIG = dict(dtype="float32", device="cpu", kv_cache_memory=8 << 20, compile=False)
"""``LLM`` keywords of every tiny embedding model."""
MATRYOSHKA = [16, 32, 64]
"""The Matryoshka dimensions the tiny Qwen3 checkpoint declares."""


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama (hidden 64) with the conformance suites' word-level tokenizer (``t0`` … ``t255``)."""
    from modelrunner_kit.conformance.models import tiny_checkpoint

    return tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("pool-llama"))


def write_sentence_transformers(path: Path, pooling_mode: str, normalize: bool) -> None:
    """The files sentence-transformers (and vLLM) read a checkpoint's pooling from."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": 64, "pooling_mode": pooling_mode, "include_prompt": True}))


@pytest.fixture(scope="session")
def qwen3_embedding_dir(tmp_path_factory) -> Path:
    """A 2-layer random ``Qwen3ForCausalLM`` (hidden 64, q/k norms) saved as Qwen3-Embedding is: its
    sentence-transformers modules pool the last token and normalise; ``matryoshka_dimensions`` 16/32/64."""
    from transformers import Qwen3Config

    from modelrunner_kit.conformance.models import VOCAB_SIZE, tiny_checkpoint

    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                         architectures=["Qwen3ForCausalLM"])
    config.matryoshka_dimensions = MATRYOSHKA
    path = tiny_checkpoint(config, tmp_path_factory.mktemp("pool-qwen3"))
    write_sentence_transformers(path, "lasttoken", normalize=True)
    return path


@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory) -> Path:
    """A 2-layer random ``BertModel`` (an encoder: no adapter but the generic transformers one) saved as
    sentence-transformers' MiniLM-style models are: mean pooling, then ``Normalize``."""
    import torch
    from transformers import BertConfig, BertModel

    from modelrunner_kit.conformance.models import VOCAB_SIZE, tiny_tokenizer

    path = tmp_path_factory.mktemp("pool-bert")
    config = BertConfig(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(str(path))
    tiny_tokenizer(VOCAB_SIZE).save_pretrained(str(path))
    write_sentence_transformers(path, "mean", normalize=True)
    return path
