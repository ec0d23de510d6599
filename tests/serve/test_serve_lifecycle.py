"""The server's life: bad options and load failures (one line, exit 2), a full waiting queue (503 with
Retry-After), a fatal engine error (500s, /health 503), and SIGTERM with requests in flight on a
tensor-parallel model (in-flight requests finish or are aborted, exit 0, no orphan processes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from .conftest import TINY_CONFIG, TINY_ENV, ServerProcess, pythonpath_with

LONG = {"prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}


def _serve_all(*arg_lists: list[str], timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Run ``modelrunner serve ARGS`` for each list, all at once; their results."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **TINY_ENV}
    procs = [subprocess.Popen([sys.executable, "-m", "modelrunner.cli", "serve", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for args in arg_lists]
    results = []
    for args, proc in zip(arg_lists, procs):
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return results


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("modelrunner: error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_bad_options_a_port_in_use_and_a_model_that_cannot_load_fail_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        results = _serve_all(["--set", "nope=1"], ["--port", "70000"], ["--grace-period", "-1"],
                             ["--max-waiting-requests", "-3"], ["--port", str(port)],
                             ["--model", str(tmp_path / "no-such-model"), "--port", "0"])
    expected = ["nope", "port", "grace-period", "max-waiting-requests", f"cannot listen on 127.0.0.1:{port}",
                "no-such-model"]
    for result, words in zip(results, expected):
        assert words in _one_error_line(result), result.stderr
    assert "modelrunner: serving" in results[-1].stderr  # it listened first, then reported the failure


# -- a small engine: back-pressure, then a fatal error ----------------------------------------------


@pytest.fixture(scope="module")
def fatal_file(tmp_path_factory):
    """The file whose existence makes the faults plugin raise FatalError in every forward."""
    return tmp_path_factory.mktemp("fatal") / "now"


@pytest.fixture(scope="module")
def small(serve_llama_dir, faults_plugin_path, fatal_file):
    """A server running at most 2 sequences with 1 waiting, and the faults plugin."""
    proc = ServerProcess(["--model", str(serve_llama_dir), *TINY_CONFIG, "--set", "max_num_seqs=2",
                          "--max-waiting-requests", "1", "--grace-period", "5"],
                         env={**TINY_ENV, "PYTHONPATH": pythonpath_with(faults_plugin_path),
                              "SERVE_TEST_FATAL_FILE": str(fatal_file)})
    try:
        yield proc.wait_ready()
    finally:
        started = time.monotonic()
        assert proc.stop(signal.SIGINT) == 0, proc.stderr
        assert time.monotonic() - started < 15
        assert "Traceback" not in proc.stderr, proc.stderr


def test_a_full_waiting_queue_answers_503_with_retry_after(small):
    with httpx.Client(base_url=small.url, timeout=30) as client, contextlib.ExitStack() as streams:
        for _ in range(3):  # 2 run, 1 waits
            r = streams.enter_context(client.stream("POST", "/v1/completions", json=LONG))
            assert r.status_code == 200
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded" and "max_waiting_requests" in r.json()["error"]["message"]
    deadline = time.monotonic() + 5
    while small.metrics()["modelrunner:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    r = httpx.post(small.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_fatal_engine_error_fails_requests_with_500_and_shows_in_health(small, fatal_file):
    with httpx.stream("POST", small.url + "/v1/completions", json=LONG, timeout=30) as r:
        events = r.iter_lines()
        assert next(e for e in events if e.startswith("data: "))
        fatal_file.touch()
        rest = [line[6:] for line in events if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert "injected fatal error" in error["message"], rest[-2]
    health = httpx.get(small.url + "/health")
    assert health.status_code == 503 and "injected fatal error" in health.json()["detail"]
    r = httpx.post(small.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead", r.text
    assert httpx.get(small.url + "/metrics").status_code == 200


# -- tensor parallel: loading, then SIGTERM with requests in flight --------------------------------


def _workers(pid: int) -> list[psutil.Process]:
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "multiprocessing.resource_tracker" not in " ".join(child.cmdline()):
                out.append(child)
    return out


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stream_in_thread(url: str, body: dict, first: threading.Event, events: list[dict | str]) -> threading.Thread:
    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_sigterm_lets_requests_finish_aborts_the_rest_and_exits_0_without_orphans(serve_llama_dir):
    grace = 3.0
    proc = ServerProcess(["--model", str(serve_llama_dir), *TINY_CONFIG, "--set", "tensor_parallel_size=2",
                          "--grace-period", str(grace)], env=TINY_ENV)
    try:
        url = proc.wait_listening()
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "loading", health.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading" and r.headers["retry-after"]
        proc.wait_ready()
        workers = _workers(proc.proc.pid)
        assert len(workers) == 1, workers  # rank 1
        short, long = [], []
        short_started, long_started = threading.Event(), threading.Event()
        threads = [_stream_in_thread(url, {**LONG, "max_tokens": 5}, short_started, short),
                   _stream_in_thread(url, LONG, long_started, long)]
        assert short_started.wait(30) and long_started.wait(30)
        sent = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        status = proc.proc.wait(grace + 30)
        took = time.monotonic() - sent
        for thread in threads:
            thread.join(10)
        assert status == 0, proc.stderr
        assert took < grace + 15, f"exit took {took:.1f} s"
        assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
        assert long[-1] == "[DONE]" and long[-2]["choices"][0]["finish_reason"] == "abort"
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), "a tensor-parallel worker outlived the server"
        assert "aborting 1 request(s)" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    finally:
        proc.stop(signal.SIGKILL)
