"""The server on the real default model (SmolLM2-135M-Instruct) gives what the offline API gives,
token for token: completions and chat, streamed and not, log-probabilities included."""

from __future__ import annotations

import math

import pytest

from .conftest import ServerProcess

pytestmark = pytest.mark.slow

CONFIG = dict(max_model_len=512, kv_cache_memory=128 << 20)
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    """``modelrunner serve`` with its defaults: the model "smollm2"."""
    args = [a for key, value in CONFIG.items() for a in ("--set", f"{key}={value}")]
    proc = ServerProcess(args)
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.stderr


@pytest.fixture(scope="module")
def llm():
    """The offline API on the same model and config."""
    from modelrunner import LLM

    return LLM("smollm2", **CONFIG)


def greedy(max_tokens: int, **extra):
    from modelrunner import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def test_completion_matches_offline_greedy_token_for_token(server, llm):
    ref = llm.generate(PROMPT, greedy(24), use_tqdm=False)[0]
    out = server.client().completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0,
                                             extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == ref.outputs[0].token_ids
    assert choice.text == ref.outputs[0].text and choice.text.startswith(" Paris")
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ref.prompt_token_ids),
                                                                      len(ref.outputs[0].token_ids))
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_completion_matches_offline_greedy(server, llm):
    ref = llm.generate(PROMPT, greedy(24), use_tqdm=False)[0].outputs[0]
    text, ids, finish, usage = "", [], None, None
    for chunk in server.client().completions.create(model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body={"return_token_ids": True}):
        for choice in chunk.choices:
            text += choice.text
            ids += choice.model_extra["token_ids"]
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert (ids, text, finish) == (ref.token_ids, ref.text, ref.finish_reason)
    assert usage.completion_tokens == len(ref.token_ids)


def test_chat_matches_offline_greedy(server, llm):
    ref = llm.chat(MESSAGES, greedy(40), use_tqdm=False)[0]
    out = server.client().chat.completions.create(model="smollm2", messages=MESSAGES, max_completion_tokens=40,
                                                  temperature=0, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.model_extra["token_ids"] == ref.outputs[0].token_ids
    assert choice.message.content == ref.outputs[0].text and "Paris" in choice.message.content
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert out.model_extra["prompt_token_ids"] == ref.prompt_token_ids
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streamed_chat_matches_offline_greedy_and_ends_with_usage(server, llm):
    ref = llm.chat(MESSAGES, greedy(40), use_tqdm=False)[0]
    chunks = list(server.client().chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == ref.outputs[0].text and finishes == [ref.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_n_2_with_a_seed_is_reproducible_and_matches_offline(server, llm):
    from modelrunner import SamplingParams

    kwargs = dict(model="smollm2", prompt="Once upon a time", n=2, max_tokens=16, temperature=0.8, seed=1234)
    first = server.client().completions.create(**kwargs)
    second = server.client().completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text
    ref = llm.generate("Once upon a time", SamplingParams(n=2, max_tokens=16, temperature=0.8, seed=1234),
                       use_tqdm=False)[0]
    assert [c.text for c in first.choices] == [c.text for c in ref.outputs]


def test_completion_logprobs_in_openai_format_match_offline(server, llm):
    ref = llm.generate(PROMPT, greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    out = server.client().completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0,
                                             logprobs=3, echo=True)
    lp = out.choices[0].logprobs
    prompt_len = len(llm.get_tokenizer().encode(PROMPT))
    assert len(lp.tokens) == prompt_len + 6 and out.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for got, want, token_id in zip(lp.token_logprobs[prompt_len:], ref.logprobs, ref.token_ids):
        assert math.isclose(got, want[token_id].logprob, abs_tol=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs[prompt_len:])  # greedy: the chosen token is in the top 3
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_chat_logprobs_in_openai_format(server):
    out = server.client().chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=5, temperature=0,
                                                  logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.token == item.top_logprobs[0].token and item.logprob == item.top_logprobs[0].logprob  # greedy
        assert item.bytes == list(item.token.encode("utf-8"))
    assert "".join(item.token for item in content) == out.choices[0].message.content


def test_a_stop_string_ends_with_finish_reason_stop(server, llm):
    ref = llm.generate(PROMPT, greedy(30, stop=["."]), use_tqdm=False)[0].outputs[0]
    out = server.client().completions.create(model="smollm2", prompt=PROMPT, max_tokens=30, temperature=0, stop=".")
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == "."


def test_models_and_tokenize_describe_the_default_model(server, llm):
    models = server.client().models.list().data
    assert [m.id for m in models] == ["smollm2"] and models[0].model_extra["max_model_len"] == 512
    r = server.post("/tokenize", {"messages": MESSAGES})
    assert r.json()["tokens"] == llm.chat_prompt(MESSAGES)["prompt_token_ids"]
