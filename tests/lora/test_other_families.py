"""LoRA on the other native adapters, through the kernel's linear layers, against transformers + peft
(float32, greedy): the attention of the MoE adapter (a tiny Mixtral; experts carry no LoRA) and
LLaVA's language model (a tiny LLaVA, text prompts; the vision tower carries none)."""

from __future__ import annotations

import torch

from modelrunner import LLM, LoRARequest, SamplingParams
from peft_adapters import random_peft_lora

TOKENS = 12
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _greedy(model, prompt_ids: list[int]) -> list[int]:
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def _ours(path, adapter, prompts) -> tuple[list[list[int]], list[list[int]]]:
    """(with the adapter, without) greedy tokens of ``prompts`` from one mixed batch."""
    llm = LLM(str(path), dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8, max_model_len=128,
              kv_cache_memory=4 << 20)
    try:
        request = LoRARequest("a", 1, str(adapter))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2],
                            SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True),
                            lora_request=[request] * len(prompts) + [None] * len(prompts), use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    return tokens[:len(prompts)], tokens[len(prompts):]


def test_mixtral_attention_lora_matches_peft(tmp_path):
    from modelrunner_kit.conformance.models import tiny_checkpoint
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("MixtralForCausalLM", tmp_path)
    prompts = [[1, 5, 9, 17, 30], [1, 40, 41, 42]]
    base = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    want_base = [_greedy(base, p) for p in prompts]
    peft_model = random_peft_lora(base, tmp_path / "adapter", seed=3, targets=ATTENTION)
    want = [_greedy(peft_model, p) for p in prompts]
    got, got_base = _ours(path, tmp_path / "adapter", prompts)
    assert got == want and got_base == want_base
    assert got != got_base  # the adapter changes the output


def test_llava_language_model_lora_matches_peft(smollm2_dir, tmp_path):
    from mm.checkpoint import save_tiny_llava
    from transformers import LlavaForConditionalGeneration

    path = tmp_path / "llava"
    _, processor = save_tiny_llava(path, smollm2_dir)
    prompts = [processor.tokenizer.encode(p) for p in ("The capital of France is", "Once upon a time")]
    base = LlavaForConditionalGeneration.from_pretrained(str(path), torch_dtype=torch.float32)
    want_base = [_greedy(base, p) for p in prompts]
    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    peft_model = random_peft_lora(base, tmp_path / "adapter", seed=4, targets=targets)
    want = [_greedy(peft_model, p) for p in prompts]
    got, got_base = _ours(path, tmp_path / "adapter", prompts)
    assert got == want and got_base == want_base
    assert got != got_base
