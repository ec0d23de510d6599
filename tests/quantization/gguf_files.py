"""Writing small GGUF files for tests: a transformers Llama's weights quantized with the ``gguf``
package (as llama.cpp's converter does: query/key rows permuted, ggml block types), with the real
SmolLM2 file's tokenizer metadata, so modelrunner reads them exactly as it reads downloaded files."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from modelrunner_kit.conformance.gguf import add_tokenizer, tokenizer_fields, write_gguf
from modelrunner.loading.source import resolve_source


def write_llama_gguf(model, path: Path, types: dict[str, T] | None = None, default: T = T.Q8_0, **kwargs) -> Path:
    """Write transformers Llama ``model`` to ``path`` as llama.cpp would, with SmolLM2's tokenizer.

    :param types: GGUF tensor-name substring → ggml type (first match wins), for 2-D weights;
        others take ``default``. Norms are always F32; the K-quants and IQ4 get random well-formed
        blocks (gguf-py cannot quantize them: :func:`~modelrunner_kit.conformance.gguf.random_blocks`).
    """
    state = ((k, v.detach().float().numpy()) for k, v in model.state_dict().items())
    return write_gguf(model.config, state, path, types or {}, default, metadata=_copy_tokenizer, **kwargs)


def _copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    add_tokenizer(writer, _smollm2_tokenizer())


@functools.cache
def _smollm2_tokenizer() -> dict:
    """SmolLM2's GGUF tokenizer fields, read once per process (parsing the file takes seconds)."""
    return tokenizer_fields(resolve_source("smollm2").path)


def tiny_llama(hidden: int = 64, intermediate: int = 128, vocab: int = 49152, tie: bool = True, seed: int = 0):
    """A 2-layer random transformers Llama (4 heads, 2 KV heads) sized for SmolLM2's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                         max_position_embeddings=512, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model
