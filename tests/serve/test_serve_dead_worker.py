"""A tensor-parallel worker killed while the server is idle: /health turns 503 within seconds and
requests get a 503 naming the rank and the signal (a real TP=2 server on a tiny model)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import psutil

from .conftest import TINY_CONFIG, TINY_ENV, ServerProcess

HEALTH_BOUND_S = 5.0
"""How soon after a worker's death /health must say so."""


def _worker(pid: int) -> psutil.Process:
    workers = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "modelrunner_executor_mp.worker" in " ".join(child.cmdline()):
                workers.append(child)
    assert len(workers) == 1, workers
    return workers[0]


def test_a_worker_killed_while_idle_turns_health_503_and_requests_name_it(serve_llama_dir):
    proc = ServerProcess(["--model", str(serve_llama_dir), *TINY_CONFIG, "--set", "tensor_parallel_size=2"],
                         env=TINY_ENV)
    try:
        url = proc.wait_ready().url
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        worker = _worker(proc.proc.pid)
        os.kill(worker.pid, signal.SIGKILL)
        killed = time.monotonic()
        while True:
            health = httpx.get(url + "/health", timeout=5)
            if health.status_code != 200 or time.monotonic() - killed > HEALTH_BOUND_S:
                break
            time.sleep(0.1)
        assert health.status_code == 503, f"/health still 200 {time.monotonic() - killed:.1f} s after the kill"
        assert time.monotonic() - killed <= HEALTH_BOUND_S
        detail = health.json()["detail"]
        assert "rank 1" in detail and f"pid {worker.pid}" in detail and "SIGKILL" in detail, detail
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "engine_dead" and "rank 1" in error["message"] and "SIGKILL" in error["message"]
        assert proc.stop(signal.SIGTERM, timeout=30) == 0, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
    finally:
        proc.stop(signal.SIGKILL)
