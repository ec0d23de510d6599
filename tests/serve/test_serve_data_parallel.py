"""A real ``modelrunner serve --data-parallel-size 2`` on a tiny model, driven over HTTP: answers equal
the offline greedy text, both replicas serve, a killed replica fails only its own requests and turns
/health 503 while the survivor goes on, and SIGTERM stops the rest cleanly."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import httpx
import psutil
import pytest

from .conftest import TINY_CONFIG, TINY_ENV, TINY_LLM_CONFIG, ServerProcess

HEALTH_BOUND_S = 5.0
"""How soon after a replica's death /health must say so (the issue's bound)."""
READY_LINE = re.compile(r"data-parallel replica (\d+) ready \(pid (\d+) ")
PROMPTS = [f"Story {i}: once upon a time" for i in range(32)]


@pytest.fixture(scope="module")
def dp_server(serve_llama_dir):
    proc = ServerProcess(["--model", str(serve_llama_dir), *TINY_CONFIG, "--data-parallel-size", "2"], env=TINY_ENV)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop(signal.SIGKILL)


def replica_pids(server: ServerProcess) -> dict[int, int]:
    """rank → pid, from the server's ``replica N ready (pid P ...)`` lines."""
    return {int(m.group(1)): int(m.group(2)) for m in map(READY_LINE.search, server.lines) if m}


def test_32_concurrent_requests_equal_offline_greedy_and_both_replicas_serve(dp_server, serve_llama_dir):
    from modelrunner import LLM, SamplingParams

    async def ask_all() -> list[str]:
        client = dp_server.async_client()
        answers = await asyncio.gather(*(client.completions.create(model=str(serve_llama_dir), prompt=p, max_tokens=8,
                                                                   temperature=0) for p in PROMPTS))
        return [a.choices[0].text for a in answers]

    before = dp_server.metrics()
    texts = asyncio.run(ask_all())
    llm = LLM(str(serve_llama_dir), **TINY_LLM_CONFIG)
    try:
        offline = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0),
                                                           use_tqdm=False)]
    finally:
        llm.shutdown()
    assert texts == offline
    after = dp_server.metrics()
    served = [after[f"modelrunner:replica_requests_served_total{{engine={r}}}"]
              - before[f"modelrunner:replica_requests_served_total{{engine={r}}}"] for r in (0, 1)]
    assert sum(served) == 32 and min(served) >= 8, served  # balanced by load: both take a share
    assert after["modelrunner:replica_up{engine=0}"] == after["modelrunner:replica_up{engine=1}"] == 1
    # A stream goes through the router as well.
    chunks = list(dp_server.client().completions.create(model=str(serve_llama_dir), prompt=PROMPTS[0], max_tokens=8,
                                                        temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == offline[0]
    # A client that disconnects mid-stream: the abort reaches the replica running its request.
    with httpx.stream("POST", dp_server.url + "/v1/completions", timeout=60, json={
            "prompt": "Endless", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(4)]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = dp_server.metrics()
        if m["modelrunner:replica_requests_in_flight{engine=0}"] + m["modelrunner:replica_requests_in_flight{engine=1}"] == 0:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the disconnected request still runs: {m}")


def test_a_stopped_replica_holds_up_neither_health_nor_the_other_replicas_requests(dp_server):
    # Issue 52 item 9: requests were handed to replicas on the event loop, so a SIGSTOPped replica (its
    # socket full) froze /health for up to 43 s and made other requests fail.
    from modelrunner_data_parallel.client import STALE_S

    pids = replica_pids(dp_server)
    stopped = psutil.Process(pids[1])
    stopped.suspend()
    try:
        started = time.monotonic()
        while time.monotonic() - started < STALE_S + 0.5:  # its heartbeat goes late meanwhile
            t = time.monotonic()
            assert httpx.get(dp_server.url + "/health", timeout=5).status_code == 200
            assert time.monotonic() - t < 1.0
            time.sleep(0.1)

        async def many() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=dp_server.url, timeout=30) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json={
                    "prompt": f"Short {i}" + "x" * 2000, "max_tokens": 4, "temperature": 0}) for i in range(20)))

        t = time.monotonic()
        responses = asyncio.run(many())
        assert [r.status_code for r in responses] == [200] * 20, [r.text for r in responses if r.status_code != 200]
        assert time.monotonic() - t < 20
        assert httpx.get(dp_server.url + "/health", timeout=5).status_code == 200
    finally:
        stopped.resume()
    time.sleep(STALE_S)  # its heartbeat again: it takes requests again
    r = httpx.post(dp_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_killed_replica_fails_only_its_requests_and_health_says_so_then_sigterm_stops_cleanly(dp_server):
    pids = replica_pids(dp_server)
    assert sorted(pids) == [0, 1], dp_server.stderr
    results: list[httpx.Response | BaseException] = []

    def ask(i: int) -> None:
        try:
            results.append(httpx.post(dp_server.url + "/v1/completions", timeout=120, json={
                "prompt": f"Long {i}", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}))
        except BaseException as e:  # noqa: BLE001
            results.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until both replicas run two requests each
        m = dp_server.metrics()
        if all(m[f"modelrunner:replica_requests_in_flight{{engine={r}}}"] == 2 for r in (0, 1)):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the requests did not spread over both replicas: {m}")
    psutil.Process(pids[1]).kill()
    killed = time.monotonic()
    while (health := httpx.get(dp_server.url + "/health", timeout=5)).status_code == 200:
        assert time.monotonic() - killed < HEALTH_BOUND_S, "/health still 200 after the replica died"
        time.sleep(0.05)
    assert health.status_code == 503
    detail = health.json()["detail"]
    assert "replica 1" in detail and f"pid {pids[1]}" in detail and "SIGKILL" in detail, detail
    for t in threads:
        t.join(120)
    codes = sorted(r.status_code for r in results if isinstance(r, httpx.Response))
    assert codes == [200, 200, 500, 500], results
    failed = [r.json()["error"]["message"] for r in results if r.status_code == 500]
    assert all("replica 1" in message for message in failed), failed
    # New requests go to the survivor.
    r = httpx.post(dp_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    m = dp_server.metrics()
    assert m["modelrunner:replica_up{engine=1}"] == 0 and m["modelrunner:replica_up{engine=0}"] == 1
    # SIGTERM: the server drains and stops the surviving replica; nothing is left behind.
    server = psutil.Process(dp_server.proc.pid)
    survivor = psutil.Process(pids[0])
    assert dp_server.stop(signal.SIGTERM, timeout=60) == 0, dp_server.stderr
    assert "Traceback" not in dp_server.stderr, dp_server.stderr
    assert not survivor.is_running() or survivor.status() == psutil.STATUS_ZOMBIE
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
