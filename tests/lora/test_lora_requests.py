"""LoRA through the offline API: bad adapters refused naming the file and the problem (the engine keeps
serving), at most max_loras adapters per step, no prefix-cache sharing across adapters, beam search,
chat and unloading."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelrunner import LLM, LoRARequest, SamplingParams
from modelrunner.config import RunnerConfig
from modelrunner.engine.beam_search import BeamSearchParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(100, 140))}  # 40 tokens: two full KV blocks and a half


def tokens(llm, lora=None, prompt=PROMPT):
    out = llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)[0]
    assert out.error is None, out.error
    return out.outputs[0].token_ids, out.num_cached_tokens


def edited_copy(src, dst, config_edit=None, tensors_edit=None):
    """A copy of the adapter at ``src`` with its config and/or tensors changed."""
    shutil.copytree(src, dst)
    if config_edit:
        config = json.loads((dst / "adapter_config.json").read_text())
        config.update(config_edit)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    if tensors_edit:
        tensors = load_file(str(dst / "adapter_model.safetensors"))
        save_file(tensors_edit(tensors), str(dst / "adapter_model.safetensors"))
    return dst


def _rename(tensors, old, new):
    return {k.replace(old, new): v for k, v in tensors.items()}


def _widen_a(tensors):
    return {k: torch.cat([v, v], 1) if "lora_A" in k else v for k, v in tensors.items()}


BAD = [
    ("dora", {"use_dora": True}, None, "use_dora"),
    ("modules", {"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ("pattern", {"rank_pattern": {"q_proj": 4}}, None, "rank_pattern"),
    ("bias", {"bias": "all"}, None, "bias='all'"),
    ("rank", {"r": 32}, None, "exceeds max_lora_rank=8"),
    ("layer", None, lambda t: _rename(t, "layers.1.", "layers.7."), "not in the model"),
    ("target", None, lambda t: _rename(t, "q_proj", "c_attn"), "'c_attn'"),
    ("hidden", None, _widen_a, "input features but the model's layer takes"),
]


@pytest.mark.parametrize("name,config_edit,tensors_edit,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_adapter_refused_and_engine_keeps_serving(lora_llm, peft_adapters, tmp_path, name, config_edit,
                                                      tensors_edit, expected):
    bad = edited_copy(peft_adapters[0], tmp_path / name, config_edit, tensors_edit)
    with pytest.raises(ValueError, match="prompt 0: .*" + str(bad).replace("\\", "\\\\")) as info:
        lora_llm.generate(PROMPT, GREEDY, lora_request=LoRARequest(name, 100 + len(name), str(bad)), use_tqdm=False)
    assert expected in str(info.value)
    assert tokens(lora_llm)[0]  # still serving


def test_missing_files(lora_llm, peft_adapters, tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        lora_llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("x", 90, str(tmp_path / "nope")))
    shutil.copytree(peft_adapters[0], tmp_path / "noweights")
    (tmp_path / "noweights" / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weight file"):
        lora_llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("x", 91, str(tmp_path / "noweights")))
    (tmp_path / "noconfig").mkdir()
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        lora_llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("x", 92, str(tmp_path / "noconfig")))


def test_request_and_config_validation(lora_llm, peft_adapters, tiny_llama_dir):
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, str(peft_adapters[0]))
    lora_llm.llm_engine.add_lora(LoRARequest("a", 1, str(peft_adapters[0])))
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'a'"):
        lora_llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("b", 1, str(peft_adapters[1])))
    with pytest.raises(ValueError, match="got 2 lora_request entries for 1 prompts"):
        lora_llm.generate(PROMPT, GREEDY, lora_request=[None, None])
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        RunnerConfig.from_dict({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1})
    plain = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            plain.generate(PROMPT, GREEDY, lora_request=LoRARequest("a", 1, str(peft_adapters[0])))
    finally:
        plain.shutdown()


def test_more_adapters_than_slots_wait_and_lru(lora_llm, peft_adapters, tmp_path):
    """Three adapters over two slots (and two kept read): every request finishes, each with its own
    adapter's tokens (id 3 is a copy of id 1, on another path)."""
    copy = shutil.copytree(peft_adapters[0], tmp_path / "copy")
    loras = [LoRARequest("a", 1, str(peft_adapters[0])), LoRARequest("b", 2, str(peft_adapters[1])),
             LoRARequest("c", 3, str(copy)), None]
    alone = [tokens(lora_llm, lora)[0] for lora in loras]
    outs = lora_llm.generate([PROMPT] * 4, GREEDY, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert alone[0] == alone[2] != alone[1] and alone[3] not in alone[:3]
    stats = lora_llm.stats()["lora"]
    assert len(stats["read"]) <= 2 and len(stats["slots"]) == 2


def test_prefix_cache_is_per_adapter(lora_llm, peft_adapters):
    prompt = {"prompt_token_ids": list(range(300, 340))}
    a = LoRARequest("a", 1, str(peft_adapters[0]))
    first, cached = tokens(lora_llm, a, prompt)
    assert cached == 0
    base, cached = tokens(lora_llm, None, prompt)
    assert cached == 0 and base != first  # the adapter's blocks are not the base model's
    again, cached = tokens(lora_llm, a, prompt)
    assert cached == 32 and again == first


def test_beam_search_and_chat(lora_llm, peft_adapters):
    a = LoRARequest("a", 1, str(peft_adapters[0]))
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with_a, base = lora_llm.beam_search([PROMPT, PROMPT], params, lora_request=[a, None])
    assert with_a.sequences[0].tokens != base.sequences[0].tokens
    assert lora_llm.beam_search(PROMPT, params, lora_request=a)[0].sequences[0].tokens == with_a.sequences[0].tokens
    b, c = LoRARequest("b", 2, str(peft_adapters[1])), LoRARequest("c", 4, str(peft_adapters[1]))
    with pytest.raises(ValueError, match="use 3 LoRA adapters and max_loras is 2"):
        lora_llm.beam_search([PROMPT] * 3, params, lora_request=[a, b, c])
    messages = [{"role": "user", "content": "hi"}]
    chat_a = lora_llm.chat(messages, GREEDY, lora_request=a, use_tqdm=False)[0].outputs[0].token_ids
    chat_base = lora_llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert chat_a != chat_base


def test_unload_refused_while_in_flight(lora_llm, peft_adapters):
    engine = lora_llm.llm_engine
    a = LoRARequest("a", 1, str(peft_adapters[0]))
    engine.add_request("in-flight", PROMPT, GREEDY, lora_request=a)
    with pytest.raises(ValueError, match="used by 1 unfinished request"):
        engine.remove_lora(1)
    engine.run_until_finished(["in-flight"])
    assert engine.remove_lora(1) is True
    assert 1 not in [r.lora_int_id for r in engine.list_loras()]
    assert tokens(lora_llm, a)[0]  # added again on use
