"""Real-size shapes at small depth (issue 51): one decoder layer of Llama-3.2-1B's and of Llama-3.1-8B's
widths in Q4_K_M's formats (Q4_K, with Q6_K for the value projection, the down projection and the
LM head / tied embedding) — the memory and speed bugs of a 1B-8B model hide at these shapes, not at
SmolLM2's. The layers keep the file's blocks or their exact planar forms, decode (graphs where the
compile backend records them), and equal the file dequantized by the ``gguf`` package."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from transformers import LlamaConfig

from modelrunner import LLM, SamplingParams
from modelrunner_kit.conformance.gguf import add_tokenizer, write_gguf

from .gguf_files import _smollm2_tokenizer

Q4_K_M = {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K, "token_embd": T.Q6_K, "attn": T.Q4_K,
          "ffn": T.Q4_K}
"""Q4_K_M's choice for a layer llama.cpp gives more bits (its first and last eighth of the layers)."""
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         tie_word_embeddings=False),
}
KW = dict(max_model_len=256, kv_cache_memory=2**24)


def _write(tmp_path, shape: str):
    config = LlamaConfig(**SHAPES[shape], num_hidden_layers=1, vocab_size=49152, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    hidden, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * hidden // config.num_attention_heads
    layer = {"input_layernorm": (hidden,), "self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
             "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
             "post_attention_layernorm": (hidden,), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
             "mlp.down_proj": (hidden, inter)}
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden),
              **{f"model.layers.0.{name}.weight": dims for name, dims in layer.items()}, "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    # Every matrix is a K-quant, written as random well-formed blocks: the float values are not read.
    tensors = ((name, np.ones(dims, dtype=np.float32) if len(dims) == 1 else np.broadcast_to(np.float32(0), dims))
               for name, dims in shapes.items())
    return write_gguf(config, tensors, tmp_path / f"{shape}.gguf", Q4_K_M, T.Q4_K,
                      metadata=lambda writer: add_tokenizer(writer, _smollm2_tokenizer()))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_one_layer_of_a_real_size_q4_k_m_decodes_and_equals_the_file_dequantized(tmp_path, shape):
    from modelrunner.loading.gguf_metadata import read_tensor_table

    path = _write(tmp_path, shape)
    types = {t.name: t.ggml_type for t in read_tensor_table(path).tensors}
    assert types["blk.0.attn_q.weight"] == T.Q4_K
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == T.Q6_K
    stored = LLM(str(path), dtype="float32", **KW)
    stats = stored.stats()
    quantization = stats["quantization"]
    assert quantization["tensors"]["dequantized"] == {}
    assert sum(quantization["tensors"]["as_stored"].values()) == 8 + (shape == "llama-3.1-8b")
    assert "reference" not in quantization["kernels"].values(), quantization["kernels"]
    # No weight is held twice: what is resident is what the formats take, within the norms' floats.
    stored_bytes = stats["weights"]["resident_bytes"]
    file_bytes = path.stat().st_size
    assert stored_bytes < 1.35 * file_bytes, (stored_bytes, file_bytes)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    got = [o.outputs[0].token_ids for o in stored.generate(prompts, params, use_tqdm=False)]
    graphs = stats_graphs(stored)
    if graphs is not None:  # the cpu_fused backend: decode steps at these widths record graphs
        assert graphs["graphs"] >= 1 and not graphs["refused"] and "off" not in graphs, graphs
    dense = LLM(str(path), dtype="float32", quantization="none", **KW)
    want = dense.runner.forward(prompts[0])
    diff = (stored.runner.forward(prompts[0]) - want).abs().max().item()
    assert diff <= 1e-4 * want.abs().max().item(), diff
    assert got == [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)]


def stats_graphs(llm) -> dict | None:
    """The compile backend's decode-graph report (None: a backend without decode graphs)."""
    return llm.stats().get("compile", {}).get("decode_graphs")
