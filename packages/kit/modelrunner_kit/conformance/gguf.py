"""A tiny GGUF file for the conformance suites: a Llama checkpoint's weights in ggml blocks, as
llama.cpp's converter lays them out (query/key rows permuted, llama.cpp's tensor names).

Only what the kernel's GGUF reader needs: the ``llama.*`` metadata and the tensors. No vocabulary is
written, so the file has no tokenizer (the suites prompt with token ids); :func:`tokenizer_fields` and
:func:`add_tokenizer` copy one from another file where a test or a bench wants text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _default_types() -> dict[str, int]:
    from gguf import GGMLQuantizationType as T

    return {"attn": T.Q4_0, "ffn": T.Q4_1}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a Llama tensor (``model.layers.0.self_attn.o_proj.weight`` → ``blk.0.attn_output.weight``)."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def permute_for_gguf(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a query/key projection (what the kernel's reader undoes)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(config: Any, tensors: Iterable[tuple[str, np.ndarray]], path: str | Path,
               types: Mapping[str, int] | None = None, default: int | None = None,
               metadata: Callable[[Any], None] | None = None,
               encode: Callable[[str, np.ndarray, int], np.ndarray | None] | None = None) -> Path:
    """Write a Llama's ``(HF name, float array)`` tensors as llama.cpp's converter lays them out; ``path``.

    :param config: the transformers Llama config (the ``llama.*`` metadata comes from it).
    :param types: llama.cpp tensor-name substring → ggml type of 2-D weights (first match wins);
        default: ``attn`` Q4_0, ``ffn`` Q4_1, so Q4_0, Q4_1 and Q8_0 (the rest) all appear.
    :param default: the ggml type of the other 2-D weights (default Q8_0); 1-D tensors are always F32.
    :param metadata: called with the ``GGUFWriter`` to add more metadata (a tokenizer).
    :param encode: ``(name, array, ggml type)`` → the raw blocks of a type gguf-py cannot quantize
        (None: let gguf-py quantize it; where it cannot — the K-quants, IQ4 — :func:`random_blocks`).
    """
    import gguf
    from gguf import GGMLQuantizationType as T

    types = _default_types() if types is None else dict(types)
    default = T.Q8_0 if default is None else default
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if metadata is not None:
        metadata(writer)
    for hf_name, array in tensors:
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        name = gguf_name(hf_name)
        if name.endswith("attn_q.weight"):
            array = permute_for_gguf(array, config.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            array = permute_for_gguf(array, config.num_key_value_heads)
        kind = T.F32 if array.ndim == 1 else next((t for key, t in types.items() if key in name), default)
        raw = None if encode is None or kind in (T.F32, T.F16) else encode(name, array, kind)
        if raw is not None:
            writer.add_tensor(name, raw, raw_dtype=kind)
        elif kind == T.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif kind == T.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            try:
                blocks = gguf.quants.quantize(array, kind)
            except NotImplementedError:
                blocks = random_blocks(kind, *array.shape, seed=sum(name.encode()))
            writer.add_tensor(name, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path


_SCALE_OF = {10: (0.005, 0.005), 11: (0.002,), 12: (0.0003, 0.001), 13: (0.00015, 0.001), 14: (0.00005,),
             20: (0.002,), 23: (0.00005,)}
"""Q2_K … IQ4_XS: float16 scale(s) that keep a random block's weights within about ±0.3."""


def random_blocks(ggml_type: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Well-formed blocks of ``ggml_type`` (any format the kernel keeps as stored) with random contents
    and small scales — a weight's magnitudes — as uint8 ``[rows, bytes per row]``: for the formats
    gguf-py cannot quantize (the K-quants, IQ4_NL, IQ4_XS), so files of every format can be written.

    :raises ValueError: ``cols`` not a multiple of the format's block, or a format without a planar form.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from modelrunner.quantization.ggml_formats import HALF_FIELDS  # kernel internal: GGML blocks' float16 fields

    if ggml_type not in HALF_FIELDS:
        raise ValueError(f"no random blocks for ggml type {ggml_type}")
    per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if cols % per_block:
        raise ValueError(f"{GGMLQuantizationType(ggml_type).name} needs columns in multiples of {per_block}, got {cols}")
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // per_block, block_bytes), dtype=np.uint8)
    scales = _SCALE_OF.get(ggml_type, (0.02, 0.01))
    for offset, scale in zip(HALF_FIELDS[ggml_type], scales * 2):
        half = (scale * rng.uniform(0.5, 1.5, size=blocks.shape[:2])).astype(np.float16)
        blocks[..., offset:offset + 2] = half.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def tokenizer_fields(path: str | Path) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of the GGUF file ``path``, as plain values (JSON-serialisable)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def add_tokenizer(writer: Any, fields: Mapping[str, Any]) -> None:
    """Write the tokenizer of :func:`tokenizer_fields` to a ``gguf.GGUFWriter`` (a BPE tokenizer such as
    SmolLM2's: model, pre-tokenizer, tokens, types, merges, special ids, chat template; no BOS added)."""
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


def write_llama_gguf(checkpoint: str | Path, path: str | Path, types: Mapping[str, int] | None = None,
                     default: int | None = None) -> Path:
    """Write the Llama checkpoint directory ``checkpoint`` to the GGUF file ``path`` (see :func:`write_gguf`)."""
    from transformers import AutoConfig

    from modelrunner.loading.weights import SafetensorsCheckpoint  # kernel internal: reads the tiny checkpoint

    config: Any = AutoConfig.from_pretrained(str(checkpoint))
    if config.model_type != "llama":
        raise ValueError(f"write_llama_gguf writes Llama checkpoints; {checkpoint} is a {config.model_type!r} model")
    tensors = ((name, t.detach().float().numpy()) for name, t in SafetensorsCheckpoint(checkpoint))
    return write_gguf(config, tensors, path, types, default)


__all__ = ["add_tokenizer", "gguf_name", "permute_for_gguf", "tokenizer_fields", "write_gguf", "write_llama_gguf"]
