"""LoRA over HTTP, with the official openai client against a real ``modelrunner serve`` process:
``--lora-modules`` in both forms, the adapters in ``/v1/models`` with the base model as parent,
``model`` selecting one (the offline engine's tokens), and loading/unloading at run time."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from modelrunner import LLM, LoRARequest, SamplingParams
from peft_adapters import save_peft_adapter

from .conftest import TINY_CONFIG, TINY_ENV, TINY_LLM_CONFIG, ServerProcess, pythonpath_with

PROMPT = "Once upon a time"
LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]


@pytest.fixture(scope="module")
def adapters(serve_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-peft")
    return [save_peft_adapter(serve_llama_dir, root / f"a{i}", seed=10 + i) for i in range(2)]


@pytest.fixture(scope="module")
def server(serve_llama_dir, adapters, misbehaving_plugin_path):
    """With the slow grammar backend on its path: a request can be made to wait before it starts."""
    json_form = json.dumps({"name": "beta", "path": str(adapters[1])})
    proc = ServerProcess(["--model", str(serve_llama_dir), *TINY_CONFIG, *LORA_FLAGS, "--allow-runtime-lora-updating",
                          "--lora-modules", f"alpha={adapters[0]}", json_form],
                         env={**TINY_ENV, "PYTHONPATH": pythonpath_with(misbehaving_plugin_path)})
    with proc.serving() as ready:
        yield ready


@pytest.fixture(scope="module")
def offline(serve_llama_dir, adapters):
    """What the offline engine generates for PROMPT: base, alpha, beta."""
    llm = LLM(str(serve_llama_dir), **TINY_LLM_CONFIG, enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        loras = [None, LoRARequest("alpha", 1, str(adapters[0])), LoRARequest("beta", 2, str(adapters[1]))]
        outs = llm.generate([PROMPT] * 3, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            lora_request=loras, use_tqdm=False)
        return [o.outputs[0].text for o in outs]
    finally:
        llm.shutdown()


def _complete(client, model: str) -> str:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.model == model
    return reply.choices[0].text


def test_models_lists_adapters_with_parent(server, serve_llama_dir):
    cards = {m.id: m for m in server.client().models.list().data}
    base = str(serve_llama_dir)
    assert set(cards) == {base, "alpha", "beta"}
    assert cards["alpha"].parent == cards["beta"].parent == base and cards[base].parent is None
    assert server.client().models.retrieve("beta").parent == base


def test_model_field_selects_the_adapter(server, serve_llama_dir, offline):
    client = server.client()
    got = [_complete(client, name) for name in (str(serve_llama_dir), "alpha", "beta")]
    assert got == offline and len(set(got)) == 3
    chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "alpha" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="'gamma' is not served here"):
        _complete(client, "gamma")


def test_load_and_unload_at_run_time(server, adapters, offline, tmp_path):
    client = server.client()
    r = server.post("/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(adapters[0])})
    assert r.status_code == 200, r.text
    assert _complete(client, "gamma") == offline[1]  # the same weights as alpha
    bad = server.post("/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": str(tmp_path / "missing")})
    assert bad.status_code == 400 and "no such directory" in bad.json()["error"]["message"]
    again = server.post("/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters[1])})
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]

    stream = client.completions.create(model="gamma", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # the request runs
    busy = server.post("/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert busy.status_code == 400 and "unfinished request" in busy.json()["error"]["message"]
    stream.close()
    for _ in range(100):  # the abort reaches the engine between steps
        done = server.post("/v1/unload_lora_adapter", {"lora_name": "gamma"})
        if done.status_code == 200:
            break
        time.sleep(0.05)
    assert done.status_code == 200, done.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "gamma")
    assert _complete(client, "alpha") == offline[1]  # the others keep serving


def test_concurrent_loads_of_one_name_agree_on_one_path(server, adapters):
    async def load(path) -> tuple[str, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return str(path), await client.post(server.url + "/v1/load_lora_adapter",
                                                json={"lora_name": "race", "lora_path": str(path)})

    async def race() -> list[tuple[str, httpx.Response]]:
        return await asyncio.gather(*(load(adapters[i % 2]) for i in range(6)))

    replies = asyncio.run(race())
    served = {path for path, reply in replies if reply.status_code == 200}
    assert len(served) == 1, [(path, reply.text) for path, reply in replies]  # the same path loads once, for all
    for path, reply in replies:
        if path not in served:
            assert reply.status_code == 400, reply.text
            assert f"'race' is already being loaded from {next(iter(served))!r}" in reply.json()["error"]["message"] \
                or "'race' is already served from" in reply.json()["error"]["message"]
    assert server.client().models.retrieve("race").root == served.pop()
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "race"}).status_code == 200


def test_a_request_naming_an_adapter_unloaded_while_it_waited_is_refused(server, adapters, offline):
    assert server.post("/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": str(adapters[0])}).status_code == 200
    body = {"model": "swap", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "guided_grammar": "compile_s=1.5 swap", "guided_decoding_backend": "slow"}
    result: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: result.append(server.post("/v1/completions", body)))
    waiting.start()
    time.sleep(0.5)  # it waits for its grammar to compile: not in the engine yet
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "swap"}).status_code == 200
    assert server.post("/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": str(adapters[1])}).status_code == 200
    waiting.join(30)
    reply = result[0]
    assert reply.status_code == 409, reply.text  # never the old weights
    error = reply.json()["error"]
    assert error["param"] == "model" and "'swap' this request named" in error["message"]
    assert "was unloaded before the request started" in error["message"]
    assert _complete(server.client(), "swap") == offline[2]  # the adapter the name serves now
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "swap"}).status_code == 200


def test_with_data_parallel_replicas_every_replica_serves_the_adapters(serve_llama_dir, adapters, offline):
    proc = ServerProcess(["--model", str(serve_llama_dir), *TINY_CONFIG, *LORA_FLAGS, "--data-parallel-size", "2",
                          "--allow-runtime-lora-updating", "--lora-modules", f"alpha={adapters[0]}"], env=TINY_ENV)
    async def ask(client, model: str, count: int) -> list[str]:
        replies = await asyncio.gather(*(client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
            for _ in range(count)))
        return [r.choices[0].text for r in replies]

    with proc.serving() as ready:
        client = ready.client()
        served = "modelrunner:replica_requests_served_total{{engine={}}}"
        before = ready.metrics()
        assert asyncio.run(ask(ready.async_client(), "alpha", 12)) == [offline[1]] * 12
        after = ready.metrics()
        assert all(after[served.format(r)] > before[served.format(r)] for r in (0, 1))  # both ran the adapter
        r = ready.post("/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": str(adapters[1])})
        assert r.status_code == 200, r.text
        assert asyncio.run(ask(ready.async_client(), "beta", 12)) == [offline[2]] * 12
        r = ready.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nonexistent/adapter"})
        assert r.status_code == 400 and "/nonexistent/adapter" in r.text, r.text
        assert ready.post("/v1/unload_lora_adapter", {"lora_name": "beta"}).status_code == 200
        assert _complete(client, str(serve_llama_dir)) == offline[0]
