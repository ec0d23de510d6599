"""Logits processors as a plugin kind: a third-party one (``tests/plugins/banned_words``, installed as a
real distribution) named by requests, applied once per step to all rows that name it, and refused
with a clear error when named wrongly."""

from __future__ import annotations

import pytest

from modelrunner import LLM, SamplingParams
from modelrunner.plugins import get_plugins

from plugin_dists import listed, run_cli

GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=8)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, kv_cache_memory=8 << 20)


def test_the_plugin_is_listed_with_its_processor():
    plugins = listed(run_cli("plugins", "--json"))
    assert plugins["banned_words"]["provides"] == {"logits_processors": ["banned_words"]}
    assert plugins["default-sampling"]["provides"]["logits_processors"] == [
        "allowed_token_ids", "bad_words", "callables", "logit_bias", "min_tokens", "penalties"]


def test_a_named_processor_bans_tokens_for_its_requests_only(llm, monkeypatch):
    import modelrunner_banned_words

    prompts = ["Hello there", "The capital of France is", "a b c"]
    baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)]
    banned = sorted({baseline[0][0], baseline[0][3], baseline[2][1]})
    calls: list[int] = []
    apply = modelrunner_banned_words.BannedWords.apply
    monkeypatch.setattr(modelrunner_banned_words.BannedWords, "apply",
                        lambda self, logits, rows: (calls.append(len(rows)), apply(self, logits, rows))[1])
    ban = SamplingParams(**GREEDY, logits_processors=[("banned_words", {"token_ids": banned})])
    out = llm.generate(prompts, [ban, SamplingParams(**GREEDY), ban], use_tqdm=False)
    got = [o.outputs[0].token_ids for o in out]
    assert got[1] == baseline[1]  # the request that named no processor is untouched
    for tokens in (got[0], got[2]):
        assert not set(tokens) & set(banned) and len(tokens) == 8
    assert got[0] != baseline[0]
    # One call per step for both rows that use it, never one per request.
    assert calls and max(calls) == 2 and len(calls) == 8


def test_words_are_banned_through_the_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    baseline = llm.generate("The capital of France is", SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    word = tokenizer.decode([baseline.token_ids[0]]).strip()
    params = SamplingParams(**GREEDY, logits_processors=[{"name": "banned_words", "args": {"words": [word]}}])
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] != baseline.token_ids[0]


def test_bad_names_and_arguments_are_refused_when_the_request_is_added(llm):
    with pytest.raises(ValueError, match=r"logits_processors: unknown logits processor 'banned_wrds'; installed: "
                                         r".*banned_words.*Did you mean 'banned_words'\?"):
        llm.generate("hi", SamplingParams(logits_processors=["banned_wrds"]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"banned_words takes 'words' and 'token_ids', got \['tokens'\]"):
        llm.generate("hi", SamplingParams(logits_processors=[("banned_words", {"tokens": [1]})]), use_tqdm=False)
    with pytest.raises(ValueError, match="'min_tokens' is built in; set its SamplingParams field instead"):
        llm.generate("hi", SamplingParams(logits_processors=["min_tokens"]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_blocking_the_builtins_refuses_the_fields_they_implement(tiny_llama_dir):
    from modelrunner.engine import LLMEngine
    from modelrunner.runner import ModelRunner

    runner = ModelRunner({"model": str(tiny_llama_dir), "device": "cpu", "kv_cache_memory": 8 << 20},
                         plugins=get_plugins(block=["default-sampling"]))
    engine = LLMEngine(runner)
    with pytest.raises(ValueError, match="repetition_penalty is set but no loaded logits processor implements it"):
        engine.add_request("r", "hi", SamplingParams(repetition_penalty=1.3))
