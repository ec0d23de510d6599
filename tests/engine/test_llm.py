"""The offline API end to end on a tiny random-weight Llama (with SmolLM2's tokenizer)."""

from __future__ import annotations

import pytest
import torch

from modelrunner import LLM, SamplingParams
from modelrunner.engine import LLMEngine
from modelrunner.plugins import get_plugins
from modelrunner.runner import ModelRunner

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [
    "Hello there",
    "The capital of France is",
    "a",
    "Once upon a time, in a land far away, there lived a",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "Why?",
]
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V · layers · kv heads · head dim · fp32


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, kv_cache_memory=64 * 16 * BYTES_PER_TOKEN)


@pytest.fixture(scope="module")
def small_llm(tiny_llama_dir) -> LLM:
    """Six 16-token blocks of KV cache: the mixed batch below must preempt."""
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, kv_cache_memory=6 * 16 * BYTES_PER_TOKEN)


def _reference_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_generate_matches_a_plain_greedy_loop(llm, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == _reference_greedy(model, out.prompt_token_ids, 12)
        assert out.num_prompt_tokens == len(out.prompt_token_ids) and out.num_generated_tokens == 12


def test_continuous_batching_with_preemption_matches_each_prompt_alone(small_llm):
    params = [SamplingParams(max_tokens=8 + 5 * i, **GREEDY) for i in range(len(PROMPTS))]
    alone = [small_llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(PROMPTS, params)]

    engine = small_llm.engine
    before = engine.scheduler.num_preemptions
    for i in range(4):
        engine.add_request(f"r{i}", PROMPTS[i], params[i])
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == 3:  # arrivals while the others decode
            for i in range(4, len(PROMPTS)):
                engine.add_request(f"r{i}", PROMPTS[i], params[i])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == alone
    assert engine.scheduler.num_preemptions > before
    assert small_llm.memory_stats()["used_blocks"] == 0


def test_seeds_reproduce_regardless_of_batch_and_differ_between_seeds(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].text
    others = SamplingParams(max_tokens=10, temperature=0.7, ignore_eos=True)
    mixed = llm.generate(PROMPTS, [seeded] + [others] * (len(PROMPTS) - 1), use_tqdm=False)
    assert mixed[0].outputs[0].text == alone
    other = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=12,
                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert other != alone


def test_n_completions(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert llm.memory_stats()["used_blocks"] == 0


def test_stream_yields_the_same_text_as_generate(llm):
    params = SamplingParams(max_tokens=20, **GREEDY)
    pieces = list(llm.generate_stream(PROMPTS[3], params))
    assert len(pieces) > 1
    assert "".join(pieces) == llm.generate(PROMPTS[3], params, use_tqdm=False)[0].outputs[0].text


def test_stop_string_on_real_text(llm):
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, stop=stop, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full.text[:full.text.index(stop)]


def test_bad_prompt_fails_alone_and_leaks_nothing(llm):
    with pytest.raises(ValueError, match=r"prompt 1: .*prompt is empty"):
        llm.generate(["fine", "", "also fine"], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 0: .*max_model_len is 128"):
        llm.generate([list(range(100, 300))], use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("fine", SamplingParams(top_p=2.0))
    engine = llm.engine
    engine.add_request("ok1", PROMPTS[0], SamplingParams(max_tokens=5, **GREEDY))
    engine.step()
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("bad", PROMPTS[1], {"temperature": -1})
    engine.add_request("ok2", PROMPTS[2], SamplingParams(max_tokens=5, **GREEDY))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["ok1", "ok2"]
    assert llm.memory_stats()["used_blocks"] == 0


def test_chat_and_progress_bar(llm, capsys):
    outs = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(max_tokens=4, **GREEDY),
                    use_tqdm=False)
    assert len(outs) == 1 and "<|im_start|>assistant" in outs[0].prompt
    capsys.readouterr()
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=2), use_tqdm=True)
    assert "Generating" in capsys.readouterr().err
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "Generating" not in capsys.readouterr().err


def test_unknown_config_key_is_rejected(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(str(tiny_llama_dir), max_num_seq=4)


@pytest.mark.parametrize("how", ["generic-adapter", "contiguous-allocator"])
def test_other_runners_give_the_same_tokens(llm, tiny_llama_dir, how):
    params = [SamplingParams(max_tokens=6, **GREEDY), SamplingParams(n=2, max_tokens=6, **GREEDY)]
    expected = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    config = {"model": str(tiny_llama_dir), "device": "cpu", "max_model_len": 128,
              "kv_cache_memory": 64 * 16 * BYTES_PER_TOKEN}
    if how == "generic-adapter":  # the model keeps its own cache: no prefix caching, forks recompute
        runner = ModelRunner(config, plugins=get_plugins(allow=[]))
    else:  # no shared blocks: a fork copies the prompt's blocks
        runner = ModelRunner({**config, "kv_allocator": "contiguous"})
    engine = LLMEngine(runner)
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), p, params[i])
    done = engine.run_until_finished(["0", "1"])
    for i in range(2):
        assert [o.token_ids for o in done[str(i)].outputs] == [o.token_ids for o in expected[i].outputs]
    assert engine.allocator.stats().used_blocks == 0


def test_shared_prefix_admitted_together_hits_the_cache_and_stays_exact(llm, tiny_llama_dir):
    prefix = list(range(1000, 1040))  # 40 tokens: two full 16-token blocks to share
    prompts = [prefix + [2000 + i, 3000 + i] for i in range(4)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    together = llm.generate(prompts, params, use_tqdm=False)
    # Computed once by the first request; the other three hit its blocks within the same step.
    assert [o.num_cached_tokens for o in together] == [0, 32, 32, 32]
    uncached = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, enable_prefix_caching=False,
                   kv_cache_memory=16 * 16 * BYTES_PER_TOKEN)
    alone = [uncached.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in alone] == [0, 0, 0, 0]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_min_tokens_holds_back_eos_on_a_real_model(llm):
    eos = llm.get_tokenizer().eos_token_id
    # Make EOS the greedy choice at once by stopping on whatever the model would say first ...
    first = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    token = first.outputs[0].token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=3, stop_token_ids=[token])
    out = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    # ... then min_tokens must keep it (and EOS) from ending the completion before 3 tokens.
    assert len(out.token_ids) >= 3 and token not in out.token_ids[:3] and eos not in out.token_ids[:3]


def test_stats_name_the_adapter_that_serves_the_model(llm):
    from importlib.metadata import version

    assert llm.stats()["adapter"] == {"plugin": "llama", "distribution": "modelrunner-llama",
                                      "version": version("modelrunner-llama"), "architecture": "LlamaForCausalLM",
                                      "model_type": "llama"}
