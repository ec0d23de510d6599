"""What one request, or one plugin, can do to everyone else (issue 52, items 2, 3, 4, 8 and 10), against
one real server on the tiny Llama with the ``serve-test-misbehaving`` plugins on its path (a slow
grammar backend and a proposer that mutates, proposes endlessly or blocks: misbehaving_plugin.py):

- CORS: ``--allow-credentials`` with the any-origin default is refused at start; with listed origins
  only those get credentialed answers.
- A grammar slow to mask never stalls another stream; a mask past its bound fails that request.
- The compile pool is fair (a small grammar never waits behind large ones), bounded (503 naming the
  busy pool), and its timeout counts from when compilation starts.
- The compiled-grammar cache is bounded by bytes.
- A proposer cannot change outputs by mutating the token ids, nor exhaust memory with an endless
  proposal, nor hold the step: it is cut off after its bound, and ``/health`` says "stuck" meanwhile.
- ``/v1/responses`` refuses a conversation that can never fit before tokenizing it, and its
  checks never run on the event loop.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from .conftest import TINY_CONFIG, TINY_ENV, ServerProcess, pythonpath_with

BLOCK, ENDLESS, MUTATE = 49101, 49102, 49103  # the misbehaving proposer's markers
PROPOSER_TIMEOUT_S = 2
ORIGIN = "https://app.example"
COMPILE_TIMEOUT_S = 1.5
MASK_TIMEOUT_S = 2
CACHE_MIB = 64
SETTINGS = {"structured_outputs_compile_threads": 1, "structured_outputs_max_queued_compiles": 1,
            "structured_outputs_compile_timeout_s": COMPILE_TIMEOUT_S,
            "structured_outputs_mask_timeout_s": MASK_TIMEOUT_S,
            "structured_outputs_cache_bytes": CACHE_MIB << 20}
SPEC = json.dumps({"method": "misbehaving", "num_speculative_tokens": 3, "disable_by_batch_size": None})
PAD = "#" * 2000  # past the small-constraint size: such a grammar waits for the general compile thread


@pytest.fixture(scope="module")
def server(serve_llama_dir, misbehaving_plugin_path):
    args = ["--model", str(serve_llama_dir), *TINY_CONFIG,
            *[a for key, value in SETTINGS.items() for a in ("--set", f"{key}={value}")],
            "--speculative-config", SPEC, "--allowed-origins", json.dumps([ORIGIN]), "--allow-credentials",
            "--max-input-items", "1000"]
    env = {**TINY_ENV, "PYTHONPATH": pythonpath_with(misbehaving_plugin_path),
           "MODELRUNNER_PROPOSER_TIMEOUT": str(PROPOSER_TIMEOUT_S), "MODELRUNNER_STEP_TIMEOUT": "0.5",
           "MISBEHAVING_BLOCK_S": "6"}
    with ServerProcess(args, env=env).serving() as ready:
        for _ in range(3):  # the first xgrammar compile builds its tokenizer tables (past the 1.5 s bound?)
            warm = ready.post("/v1/completions", {"prompt": "warm", "max_tokens": 1, "guided_choice": ["a", "b"]})
            if warm.status_code == 200:
                break
            time.sleep(1)
        yield ready


def _slow(grammar: str) -> dict:
    return {"guided_grammar": grammar, "guided_decoding_backend": "slow"}


def _complete(server: ServerProcess, body: dict, timeout: float = 60) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    reply = server.post("/v1/completions", {"temperature": 0, "ignore_eos": True, **body}, timeout=timeout)
    return reply, time.monotonic() - started


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)), daemon=True)
    thread.start()
    return thread, result


def _stream_gaps(server: ServerProcess, max_tokens: int) -> list[float]:
    """The seconds between a plain stream's chunks."""
    times = []
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
    return [b - a for a, b in zip(times, times[1:])]


# -- item 2: CORS ------------------------------------------------------------------------------------


def test_credentials_with_any_origin_are_refused_at_start_naming_the_flags():
    done = subprocess.run([sys.executable, "-m", "modelrunner.cli", "serve", "--allow-credentials", "--port", "0"],
                          capture_output=True, text=True, timeout=30)  # refused before binding or loading anything
    assert done.returncode == 2, done.stderr
    assert "--allow-credentials with --allowed-origins '[\"*\"]'" in done.stderr
    assert "--allowed-origins '[\"https://app.example\"]'" in done.stderr and "serving" not in done.stderr


def test_listed_origins_alone_get_credentialed_answers(server):
    for origin, allowed in ((ORIGIN, True), ("https://evil.example", False)):
        reply = httpx.get(server.url + "/v1/models", headers={"Origin": origin}, timeout=10)
        assert reply.headers.get("access-control-allow-origin") == (origin if allowed else None)
        assert reply.headers.get("access-control-allow-credentials") == "true"  # useless without the above


# -- item 3: grammars never stall the others ----------------------------------------------------------


def test_a_grammar_slow_to_mask_never_stalls_another_stream(server):
    slow, result = _in_thread(_complete, server, {"prompt": "x", "max_tokens": 2, **_slow("mask_s=1.5 stall")})
    time.sleep(0.3)  # its first mask is computing now
    gaps = _stream_gaps(server, 40)
    slow.join(30)
    reply, seconds = result[0]
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2
    assert max(gaps) < 1.0, gaps  # each of its masks takes 1.5 s: none of them held a step


def test_a_mask_past_its_bound_fails_that_request_naming_its_grammar(server):
    reply, seconds = _complete(server, {"prompt": "x", "max_tokens": 3, **_slow("mask_s=4 bound")})
    assert reply.status_code == 500, reply.text
    message = reply.json()["error"]["message"]
    assert f"grammar backend 'slow' took more than {MASK_TIMEOUT_S:g} s to compute the next token's mask" in message
    assert "structured_outputs_mask_timeout_s" in message
    assert seconds < MASK_TIMEOUT_S + 1.5
    assert _complete(server, {"prompt": "x", "max_tokens": 2})[0].status_code == 200


def test_the_compile_pool_is_fair_bounded_and_times_compiling_from_its_start(server):
    first, first_result = _in_thread(_complete, server, {"prompt": "x", "max_tokens": 1,
                                                         **_slow(f"compile_s=1.2 first {PAD}")})
    time.sleep(0.2)
    queued, queued_result = _in_thread(_complete, server, {"prompt": "x", "max_tokens": 1,
                                                           **_slow(f"compile_s=1.0 queued {PAD}")})
    time.sleep(0.2)
    busy, _ = _complete(server, {"prompt": "x", "max_tokens": 1, **_slow(f"compile_s=1 busy {PAD}")}, timeout=5)
    assert busy.status_code == 503 and busy.headers["retry-after"], busy.text
    assert "the grammar compile pool is busy with 2 other grammars (1 compiling, 1 waiting" in \
        busy.json()["error"]["message"]
    small, seconds = _complete(server, {"prompt": "pick", "max_tokens": 4, "guided_choice": ["yes", "no"]})
    assert small.status_code == 200 and small.json()["choices"][0]["text"] in ("yes", "no"), small.text
    assert seconds < 1.0  # the small thread took it at once: it never waited behind the large ones
    for thread, result in ((first, first_result), (queued, queued_result)):
        thread.join(30)
        assert result[0][0].status_code == 200, result[0][0].text  # queued 1 s + compiling 1 s: over 1.5 s in all
    late, seconds = _complete(server, {"prompt": "x", "max_tokens": 1, **_slow(f"compile_s=2.5 late {PAD}")})
    assert late.status_code == 400, late.text
    message = late.json()["error"]["message"]
    assert "grammar backend 'slow' did not compile grammar 'compile_s=2.5 late" in message
    assert f"within {COMPILE_TIMEOUT_S:g} s of starting (structured_outputs_compile_timeout_s)" in message
    assert seconds < COMPILE_TIMEOUT_S + 1.0
    time.sleep(1.2)  # its thread finishes


# -- item 4: the grammar cache is bounded by bytes --------------------------------------------------


def test_the_compiled_grammar_cache_is_bounded_by_bytes(server):
    process = psutil.Process(server.proc.pid)
    before = process.memory_info().rss
    for i in range(8):  # 320 MiB of compiled grammars; the cache keeps at most 64 MiB of them
        reply, _ = _complete(server, {"prompt": "x", "max_tokens": 1, **_slow(f"size_mb=40 cached-{i}")})
        assert reply.status_code == 200, reply.text
    grown = (process.memory_info().rss - before) >> 20
    assert grown < CACHE_MIB + 60, f"RSS grew by {grown} MiB"


# -- item 8: proposers --------------------------------------------------------------------------------


def _tokens(marker: int) -> list[int]:
    return [marker, 791, 2733, 13, 791, 2733, 13, 791]


def _plain(server: ServerProcess, prompt: list[int]) -> str:
    """What the model answers without speculating (a no-op logit_bias: requests with logits
    processors never speculate)."""
    reply, _ = _complete(server, {"prompt": prompt, "max_tokens": 12, "logit_bias": {"0": 0.0}})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_a_proposer_cannot_change_outputs_through_the_token_ids(server):
    prompt = _tokens(MUTATE)
    reply, _ = _complete(server, {"prompt": prompt, "max_tokens": 12})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == _plain(server, prompt)
    assert "proposer 'misbehaving' failed (AttributeError" in server.stderr  # a tuple has no append


def test_an_endless_proposal_is_cut_at_the_tokens_asked_for_and_reported(server):
    prompt = _tokens(ENDLESS)
    reply, _ = _complete(server, {"prompt": prompt, "max_tokens": 12})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == _plain(server, prompt)
    assert "proposer 'misbehaving' proposed more than the" in server.stderr
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_a_blocking_proposer_is_cut_off_and_health_says_stuck_meanwhile(server):
    prompt = _tokens(BLOCK)
    want = _plain(server, prompt)
    blocked, result = _in_thread(_complete, server, {"prompt": prompt, "max_tokens": 12})
    seen = []
    while blocked.is_alive():
        health = httpx.get(server.url + "/health", timeout=5)
        seen.append((health.status_code, health.json()))
        time.sleep(0.1)
    reply, seconds = result[0]
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == want, reply.text
    assert seconds < PROPOSER_TIMEOUT_S + 3
    stuck = [body for status, body in seen if status == 503]
    assert stuck and stuck[0]["status"] == "stuck" and "MODELRUNNER_STEP_TIMEOUT=0.5 s" in stuck[0]["detail"], seen
    assert f"proposer 'misbehaving' did not return from propose within {PROPOSER_TIMEOUT_S} s " \
           "(MODELRUNNER_PROPOSER_TIMEOUT" in server.stderr
    assert "speculative decoding is off from now on" in server.stderr
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert _complete(server, {"prompt": prompt, "max_tokens": 12})[0].json()["choices"][0]["text"] == want


# -- item 10: /v1/responses bounds before tokenizing ---------------------------------------------------


def _respond(server: ServerProcess, body: dict) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    reply = server.post("/v1/responses", {"max_output_tokens": 4, **body}, timeout=120)
    return reply, time.monotonic() - started


def test_a_responses_input_that_can_never_fit_is_refused_before_tokenizing(server):
    process = psutil.Process(server.proc.pid)
    before = process.memory_info().rss
    huge = "lorem ipsum " * 800_000  # 9.6 MB
    call_output = {"type": "function_call_output", "call_id": "c1", "output": huge}
    for body in ({"input": huge}, {"input": [{"role": "user", "content": "hi"}, call_output]}):
        reply, seconds = _respond(server, body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "input"
        assert "characters of text take at least" in error["message"] and "2048 tokens" in error["message"]
        assert seconds < 5
    assert (process.memory_info().rss - before) >> 20 < 400  # tokenizing it took gigabytes


def test_too_many_responses_items_are_refused_without_stalling_other_streams(server):
    items = [{"role": "user", "content": f"item {i}"} for i in range(50_000)]
    refused, result = _in_thread(_respond, server, {"input": items})
    gaps = _stream_gaps(server, 30)
    refused.join(60)
    reply, seconds = result[0]
    assert reply.status_code == 400, reply.text
    assert "input has 50000 items; accepted: at most 1000 (--max-input-items)" in reply.json()["error"]["message"]
    assert max(gaps) < 1.0, gaps
