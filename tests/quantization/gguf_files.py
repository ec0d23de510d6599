"""Writing small GGUF files for tests: a transformers Llama's weights quantized with the ``gguf``
package (as llama.cpp's converter does: query/key rows permuted, ggml block types), with the real
SmolLM2 file's tokenizer metadata, so modelrunner reads them exactly as it reads downloaded files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from modelrunner.source import resolve_source

_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a Llama tensor."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for a query/key projection (the inverse of what the reader undoes)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_llama_gguf(model, path: Path, types: dict[str, T] | None = None, default: T = T.Q8_0) -> Path:
    """Write transformers Llama ``model`` to ``path`` as llama.cpp would.

    :param types: GGUF tensor-name substring → ggml type (first match wins), for 2-D weights;
        others take ``default``. Norms are always F32.
    """
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    _copy_tokenizer(writer)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, array in state.items():
        name = gguf_name(hf_name)
        if name.endswith("attn_q.weight"):
            array = _permute(array, config.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            array = _permute(array, config.num_key_value_heads)
        if array.ndim == 1:
            writer.add_tensor(name, array.astype(np.float32))
            continue
        kind = next((t for key, t in (types or {}).items() if key in name), default)
        if kind == T.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif kind == T.F16:
            writer.add_tensor(name, array.astype(np.float16))
        elif kind == T.Q4_K:  # gguf-py cannot quantize K-quants: random but well-formed blocks
            writer.add_tensor(name, random_q4_k(*array.shape), raw_dtype=kind)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
    reader = gguf.GGUFReader(str(resolve_source("smollm2").path))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(fields["tokenizer.ggml.unknown_token_id"])
    writer.add_pad_token_id(fields["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(fields["tokenizer.chat_template"])


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
