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
from modelrunner.conformance.gguf import add_tokenizer, tokenizer_fields, write_gguf
from modelrunner.source import resolve_source


def write_llama_gguf(model, path: Path, types: dict[str, T] | None = None, default: T = T.Q8_0) -> Path:
    """Write transformers Llama ``model`` to ``path`` as llama.cpp would, with SmolLM2's tokenizer.

    :param types: GGUF tensor-name substring → ggml type (first match wins), for 2-D weights;
        others take ``default``. Norms are always F32; Q4_K tensors get random well-formed blocks
        (gguf-py cannot quantize K-quants).
    """
    state = ((k, v.detach().float().numpy()) for k, v in model.state_dict().items())
    return write_gguf(model.config, state, path, types or {}, default, metadata=_copy_tokenizer,
                      encode=lambda name, array, kind: random_q4_k(*array.shape) if kind == T.Q4_K else None)


def random_q4_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Q4_K blocks (256 elements in 144 bytes: fp16 ``d`` and ``dmin``, 12 bytes of 6-bit scales and
    mins, 128 bytes of nibbles) with small scales and random contents: values of a weight's size."""
    if cols % 256:
        raise ValueError(f"Q4_K needs columns in multiples of 256, got {cols}")
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


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
