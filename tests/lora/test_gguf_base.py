"""LoRA on a quantized base: the tiny Llama as a Q8_0 GGUF file (read in place, quantized matmuls) with an
adapter on all seven projections gives log-probabilities within Q8_0's tolerance of transformers + peft
on the dequantized weights (transformers reads the same GGUF file)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from modelrunner import LLM, LoRARequest, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "quantization"))
from gguf_files import write_llama_gguf  # noqa: E402

PROMPT = list(range(400, 415))
TOKENS = 6
ATOL = 2e-3
"""|Δ log-probability| allowed: Q8_0 blocks computed with float activations differ from the dequantized
float matmul by summation order only."""


def test_lora_on_gguf_base_matches_peft_on_dequantized(tiny_llama_dir, peft_adapters, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), torch_dtype=torch.float32)
    gguf_path = write_llama_gguf(hf, tmp_path / "tiny-q8_0.gguf")
    llm = LLM(str(gguf_path), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8)
    try:
        assert llm.stats()["weights"]["quantization"] == "gguf"
        out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=TOKENS,
                                                                        ignore_eos=True, logprobs=0),
                           lora_request=LoRARequest("a", 1, str(peft_adapters[0])), use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    dequantized = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_path.name,
                                                       torch_dtype=torch.float32)
    reference = PeftModel.from_pretrained(dequantized, str(peft_adapters[0])).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1:-1]
    want = torch.log_softmax(logits.double(), -1)
    got = [entry[token].logprob for entry, token in zip(out.logprobs, out.token_ids)]
    for i, token in enumerate(out.token_ids):
        assert abs(got[i] - float(want[i, token])) < ATOL, (i, got[i], float(want[i, token]))
    assert out.token_ids == want.argmax(-1).tolist()


def test_the_guides_recipe_serves_an_adapter_made_for_the_default_gguf_model(smollm2_dir, tmp_path, monkeypatch):
    """docs/guide/lora.md's section on GGUF models, run as written: peft on the dequantized weights of
    the default model's Q4_1 file makes the adapter, and LLM("smollm2") serves it over the file read in
    place, with peft's own log-probabilities (on the dequantized weights) within Q4_1's summation-order
    tolerance, and outputs that differ from the base model's."""
    from docs_blocks import code_blocks

    page = Path(__file__).parents[2] / "docs" / "guide" / "lora.md"
    lines = page.read_text().splitlines()
    start = lines.index("## An adapter for a GGUF model (the default model)") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("## ")) + 1
    blocks = [b for b in code_blocks(page) if b.language == "python" and start < b.line < end]
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile("\n" * block.line + block.code, str(page), "exec"), namespace)  # noqa: S102 - the page's code
    llm, with_demo, base_only = namespace["llm"], namespace["with_demo"].outputs[0], namespace["base_only"].outputs[0]
    try:
        assert llm.stats()["weights"]["quantization"] == "gguf" and llm.stats()["lora"]
        prompt = llm.get_tokenizer()("The capital of France is")["input_ids"]
    finally:
        llm.shutdown()
    reference = namespace["peft_model"].eval()
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + with_demo.token_ids])).logits[0, len(prompt) - 1:-1]
    want = torch.log_softmax(logits.double(), -1)
    got = [entry[token].logprob for entry, token in zip(with_demo.logprobs, with_demo.token_ids)]
    for i, token in enumerate(with_demo.token_ids):
        assert abs(got[i] - float(want[i, token])) < ATOL, (i, got[i], float(want[i, token]))
    base_first = base_only.logprobs[0][base_only.token_ids[0]].logprob
    assert with_demo.token_ids != base_only.token_ids or abs(got[0] - base_first) > 1e-2
