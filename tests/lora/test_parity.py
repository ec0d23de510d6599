"""One mixed batch (two adapters and the base model) gives, request by request, transformers + peft's
greedy tokens (float32, tiny Llama, adapters on all seven projections)."""

from __future__ import annotations

import torch

from modelrunner import LoRARequest, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
TOKENS = 16


def peft_greedy(base_dir, adapter_dir, prompt_ids: list[int]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=TOKENS, do_sample=False,
                             min_new_tokens=TOKENS, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_mixed_batch_matches_peft(lora_llm, tiny_llama_dir, peft_adapters):
    """Base steps before and after use the cpu_fused backend's recorded decode graphs; LoRA steps
    (whose layers carry hooks) run the layers eagerly, so neither loses nor keeps a delta wrongly."""
    tok = lora_llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    loras = [LoRARequest("a", 1, str(peft_adapters[0])), LoRARequest("b", 2, str(peft_adapters[1])), None]
    want = [peft_greedy(tiny_llama_dir, None if lora is None else lora.lora_path, ids)
            for ids, lora in zip(prompt_ids, loras)]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)

    def base_alone() -> int:
        out = lora_llm.generate({"prompt_token_ids": prompt_ids[2]}, params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == want[2]
        return lora_llm.stats()["compile"]["decode_graphs"]["replays"]

    replays = base_alone()
    assert replays > 0, lora_llm.stats()["compile"]
    outs = lora_llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, lora_request=loras,
                             use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want
    assert got[0] != got[2] and got[1] != got[2]  # the adapters change the output
    assert base_alone() > replays
