"""One server on a tiny random Llama: concurrency, cancellation, the OpenAI wire format, and every
error case (each followed by a request that succeeds)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from .conftest import POISON, TINY_CONFIG, TINY_ENV, TINY_LLM_CONFIG, ServerProcess, pythonpath_with

API_KEY = "test-key"
MAX_BODY = 64 << 10
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(serve_llama_dir, faults_plugin_path):
    """``modelrunner serve`` on the tiny Llama, with an API key, a 64 KiB body limit, two served names
    and the faults plugin."""
    proc = ServerProcess(["--model", str(serve_llama_dir), *TINY_CONFIG, "--api-key", API_KEY,
                          "--max-body-bytes", str(MAX_BODY), "--served-model-name", "tiny", "tiny-alias"],
                         api_key=API_KEY, env={**TINY_ENV, "PYTHONPATH": pythonpath_with(faults_plugin_path)})
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.stderr


@pytest.fixture(scope="module")
def llm(serve_llama_dir):
    """The offline API on the same checkpoint and config: the reference."""
    import torch
    from modelrunner import LLM

    torch.set_num_threads(1)
    return LLM(str(serve_llama_dir), **TINY_LLM_CONFIG)


def offline(llm, prompt, **params):
    from modelrunner import SamplingParams

    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def _ok(server: ServerProcess) -> None:
    """A normal request succeeds (run after every error case)."""
    r = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


# -- concurrency and cancellation ---------------------------------------------------------------


def test_32_concurrent_streams_each_get_exactly_the_offline_text(server, llm):
    words = "river mountain engine garden science music ocean window letter market planet winter".split()
    cases = [(" ".join(words[i % 7: i % 7 + 2 + i % 5]) + f" #{i}", 8 + (i * 7) % 33) for i in range(32)]

    async def stream_one(client, i, prompt, max_tokens):
        text, ids, finish = "", [], None
        if i % 4 == 3:  # a quarter through chat
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True,
                temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    ids += choice.model_extra.get("token_ids") or []
                    finish = choice.finish_reason or finish
        else:
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                                     temperature=0,
                                                     extra_body={"ignore_eos": True, "return_token_ids": True})
            async for chunk in stream:
                for choice in chunk.choices:
                    text += choice.text
                    ids += choice.model_extra.get("token_ids") or []
                    finish = choice.finish_reason or finish
        return text, ids, finish

    async def run_all():
        async with server.async_client() as client:
            return await asyncio.gather(*(stream_one(client, i, p, m) for i, (p, m) in enumerate(cases)))

    results = asyncio.run(run_all())
    for i, ((prompt, max_tokens), (text, ids, finish)) in enumerate(zip(cases, results)):
        request = llm.chat_prompt([{"role": "user", "content": prompt}]) if i % 4 == 3 else prompt
        ref = offline(llm, request, max_tokens=max_tokens, **GREEDY).outputs[0]
        assert ids == ref.token_ids, f"client {i}: tokens differ"
        assert text == ref.text, f"client {i}: text differs"
        assert finish == "length"


def _wait_idle(server: ServerProcess, idle_kv: float, within: float = 2.0) -> dict[str, float]:
    deadline = time.monotonic() + within
    while True:
        m = server.metrics()
        if m["modelrunner:num_requests_running"] == 0 and m["modelrunner:kv_cache_usage_perc"] == idle_kv:
            return m
        assert time.monotonic() < deadline, f"not idle {within} s after the client left: {m}"
        time.sleep(0.05)


def test_a_client_that_closes_its_stream_has_its_request_aborted(server):
    before = server.metrics()
    idle_kv = before["modelrunner:kv_cache_usage_perc"]
    aborted = before.get("modelrunner:request_success_total{finished_reason=abort}", 0)
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers(), timeout=30) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks += 1
                if chunks == 3:
                    break  # leaving iter_lines early closes the connection
    after = _wait_idle(server, idle_kv)
    assert after["modelrunner:request_success_total{finished_reason=abort}"] == aborted + 1
    _ok(server)


def test_a_client_that_gives_up_on_a_plain_request_has_it_aborted(server):
    idle_kv = server.metrics()["modelrunner:kv_cache_usage_perc"]
    body = {"prompt": "Once upon a time", "max_tokens": 2000, **GREEDY}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers(), timeout=0.5)
    _wait_idle(server, idle_kv)
    _ok(server)


# -- the wire format ------------------------------------------------------------------------------


def test_models_lists_every_served_name_and_either_name_works(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert models[0].model_extra["max_model_len"] == 2048
    assert server.client().models.retrieve("tiny-alias").id == "tiny-alias"
    out = server.client().completions.create(model="tiny-alias", prompt="Hi", max_tokens=3, temperature=0)
    assert out.model == "tiny" and out.usage.completion_tokens == 3


def test_several_prompts_with_n_2_number_choices_prompt_by_prompt(server, llm):
    out = server.client().completions.create(model="tiny", prompt=["One two", "Three four"], n=2, max_tokens=5,
                                             temperature=0.9, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    refs = [offline(llm, p, n=2, max_tokens=5, temperature=0.9, seed=7, ignore_eos=True)
            for p in ("One two", "Three four")]
    assert [c.text for c in out.choices] == [c.text for r in refs for c in r.outputs]
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert out.usage.completion_tokens == 20


def test_streamed_n_3_gives_each_choice_once_with_its_finish(server):
    client = server.client()
    kwargs = dict(model="tiny", prompt="Count", n=3, max_tokens=6, temperature=1.0, seed=3,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs)
    texts, finishes = {}, {}
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                assert choice.index not in finishes
                finishes[choice.index] = choice.finish_reason
        if not chunk.choices:
            usage = chunk.usage
    assert texts == {c.index: c.text for c in plain.choices}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 18 and usage.total_tokens == usage.prompt_tokens + 18


def test_echo_with_max_tokens_0_scores_the_prompt(server, serve_tokenizer):
    r = server.post("/v1/completions", {"prompt": "The cat sat", "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = serve_tokenizer.encode("The cat sat")
    assert choice["text"] == "The cat sat" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert r.json()["usage"]["completion_tokens"] == 0


def test_continuous_usage_stats_count_tokens_as_they_come(server):
    body = {"prompt": "Hi", "max_tokens": 4, "stream": True, **GREEDY,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers()) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_tokenize_and_detokenize(server, llm, serve_tokenizer):
    r = server.post("/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == serve_tokenizer.encode("Hello world") and r.json()["max_model_len"] == 2048
    assert r.json()["count"] == len(r.json()["tokens"]) and len(r.json()["token_strs"]) == r.json()["count"]
    messages = [{"role": "user", "content": "Hi there"}]
    r = server.post("/tokenize", {"messages": messages})
    assert r.json()["tokens"] == llm.chat_prompt(messages)["prompt_token_ids"]
    r = server.post("/detokenize", {"tokens": serve_tokenizer.encode("Hello world")})
    assert r.json() == {"prompt": "Hello world"}


def test_health_metrics_and_version_need_no_key(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket"):
        assert f"modelrunner:{name}" in text, name


# -- errors ---------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
BAD_PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="

ERROR_CASES = [
    # (path, body (bytes: sent as is), status, param, code)
    (COMPLETIONS, b'{"prompt": "Hi", ', 400, None, "invalid_json"),
    (COMPLETIONS, b"[1, 2]", 400, None, "invalid_json"),
    (COMPLETIONS, b"", 400, None, "invalid_json"),
    (COMPLETIONS, {"prompt": "Hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    (COMPLETIONS, {"prompt": "Hi", "temperature": -1}, 400, "temperature", "invalid_value"),
    (COMPLETIONS, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature", "invalid_value"),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 0}, 400, "top_p", "invalid_value"),
    (COMPLETIONS, {"prompt": "Hi", "n": 0}, 400, "n", "invalid_value"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    (COMPLETIONS, {"prompt": "Hi", "stop": [1]}, 400, "stop", "invalid_value"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"5": 500}}, 400, "logit_bias", "invalid_value"),
    (COMPLETIONS, {"prompt": "Hi", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens", "invalid_value"),
    (COMPLETIONS, {"prompt": "Hi", "logits_processors": ["no-such"]}, 400, "logits_processors", "invalid_value"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokenz": 3}, 400, "max_tokenz", "unknown_field"),
    (COMPLETIONS, {"prompt": "Hi", "suffix": "!"}, 400, "suffix", "unsupported"),
    (COMPLETIONS, {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "invalid_value"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {}, 400, "prompt", "missing_field"),
    (COMPLETIONS, {"prompt": [10 ** 9]}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {"prompt": [[1, 2], [10 ** 9]]}, 400, "prompt[1]", "invalid_value"),
    (COMPLETIONS, {"prompt": [5] * 2048}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {"prompt": "word " * 2100}, 400, "prompt", "context_length_exceeded"),
    (CHAT, {"messages": []}, 400, "messages", "invalid_value"),
    (CHAT, {"messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages[0].role", "invalid_value"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400, "messages[0].content[0].type",
     "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": BAD_PNG}}]}]},
     400, "messages[0].content[0]", "unsupported"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs", "invalid_value"),
    (CHAT, {"messages": USER, "max_completion_tokens": -1}, 400, "max_completion_tokens", "invalid_value"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice",
     "unsupported"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, 400, "tool_choice.function.name", "invalid_value"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format.json_schema.schema", "invalid_value"),
    (COMPLETIONS, {"prompt": "Hi", "guided_choice": []}, 400, "guided_choice", "invalid_value"),
    (CHAT, {"messages": USER, "chat_template": "{{ 1 }}"}, 400, "chat_template", "unsupported"),
    (CHAT, {"messages": USER, "add_generation_prompt": True, "continue_final_message": True}, 400,
     "continue_final_message", "invalid_value"),
    ("/tokenize", {"prompt": "a", "messages": USER}, 400, "prompt", "invalid_value"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]", "invalid_value"),
    ("/v1/nothing", {}, 404, None, "not_found"),
]


@pytest.mark.parametrize("path, body, status, param, code", ERROR_CASES,
                         ids=[f"{c[0]}-{c[3]}-{c[4]}-{i}" for i, c in enumerate(ERROR_CASES)])
def test_every_error_returns_its_status_and_error_object_and_the_next_request_succeeds(server, path, body, status,
                                                                                         param, code):
    if isinstance(body, bytes):
        r = server.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = server.post(path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code, error
    assert error["message"] and "Traceback" not in error["message"]
    if param:
        assert param.split("[")[0].split(".")[0] in error["message"], error["message"]
    _ok(server)


def test_the_openai_client_sees_bad_requests_as_bad_request_errors(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model="tiny", messages=USER, temperature=-1)
    assert info.value.param == "temperature"
    _ok(server)


def test_a_body_over_the_limit_gets_413_both_declared_and_chunked(server):
    big = json.dumps({"prompt": "x" * MAX_BODY}).encode()
    r = server.post(COMPLETIONS, content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = server.post(COMPLETIONS, content=iter([big[:40000], big[40000:]]), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    _ok(server)


def test_a_missing_or_wrong_api_key_gets_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        for method, path in (("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", "/tokenize")):
            r = httpx.request(method, server.url + path, json={"prompt": "Hi"}, headers=headers)
            assert r.status_code == 401, (headers, path, r.text)
            assert r.json()["error"]["code"] in ("missing_api_key", "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    _ok(server)


def test_a_request_whose_forward_fails_gets_500_and_the_others_finish(server):
    async def both():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=60) as client:
            normal = client.post(COMPLETIONS, json={"prompt": "Fine", "max_tokens": 30, **GREEDY})
            poisoned = client.post(COMPLETIONS, json={"prompt": [7, *POISON], "max_tokens": 30, **GREEDY})
            return await asyncio.gather(normal, poisoned)

    normal, poisoned = asyncio.run(both())
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 30
    assert poisoned.status_code == 500, poisoned.text
    assert poisoned.json()["error"]["code"] == "generation_failed"
    assert "poisoned" in poisoned.json()["error"]["message"]
    body = {"prompt": [7, *POISON], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + COMPLETIONS, json=body, headers=server.headers()) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == "generation_failed" and events[-1] == "[DONE]"
    assert httpx.get(server.url + "/health").status_code == 200
    _ok(server)


def test_the_load_generator_drives_the_real_server(server, tmp_path):
    """``modelrunner bench serve`` (the real load generator, over HTTP) against this server: every
    request completes with its tokens, and the JSON holds consistent per-request numbers."""
    import statistics
    import subprocess
    import sys

    from modelrunner_serve.loadgen import percentile

    report = tmp_path / "load.json"
    result = subprocess.run([sys.executable, "-m", "modelrunner.cli", "bench", "serve", "--base-url", server.url,
                             "--api-key", API_KEY, "--num-prompts", "6", "--max-concurrency", "3", "--input-len", "8",
                             "--output-len", "4", "--output-json", str(report)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    record = json.loads(report.read_text())
    summary, requests = record["summary"], record["requests"]
    assert summary["completed"] == 6 and summary["failed"] == 0 and summary["total_output_tokens"] == 24
    assert all(r["ok"] and r["prompt_tokens"] == 8 and r["output_tokens"] == 4 for r in requests)
    assert all(0 < r["ttft"] <= r["e2e"] and len(r["itls"]) <= 3 for r in requests)
    ttfts = [r["ttft"] for r in requests]
    assert summary["p50_ttft_ms"] == pytest.approx(1000 * statistics.median(ttfts))
    assert summary["p50_ttft_ms"] <= summary["p90_ttft_ms"] <= summary["p99_ttft_ms"] <= 1000 * max(ttfts) + 1e-6
    assert "p99" in result.stdout and "ITL" in result.stdout
    # Wrong key: every request fails and the exit status says so.
    bad = subprocess.run([sys.executable, "-m", "modelrunner.cli", "bench", "serve", "--base-url", server.url,
                          "--api-key", "wrong", "--num-prompts", "2", "--input-len", "4", "--output-len", "2"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode != 0 and "401" in bad.stderr
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0
