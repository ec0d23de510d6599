"""The ``ray`` executor plugin (``plugins/executor_ray``) on a Ray head started here on 127.0.0.1, as
a Ray user runs it: ``ray start --head``, ``RAY_ADDRESS``, ``distributed_executor_backend="ray"``.

Tensor parallelism of two ranks (rank 1 a Ray actor) gives one process's greedy tokens (the executor
conformance suite); a killed actor fails the next step naming its rank within seconds; the head is
stopped afterwards.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelrunner import LLM, SamplingParams
from modelrunner_executor_mp import free_port
from modelrunner.executor import WorkerFailedError

from .workload import LLM_KW, PROMPTS, run_workload

ray = pytest.importorskip("ray", reason="the ray executor plugin needs ray (make install puts it in the venv)")

REPORT_WITHIN_S = 5.0
"""A killed actor must fail the step this soon."""


def _ray_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    return subprocess.run([ray_bin, *args], capture_output=True, text=True, env=env, timeout=120)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on 127.0.0.1 with 2 CPUs (``ray start --head``); ``ray stop`` afterwards, checked."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_AUTH_MODE"] = "disabled"  # a token left in ~/.ray by an earlier local Ray would refuse the driver
    started = _ray_cli("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
                       "--include-dashboard=false", "--disable-usage-stats", env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stopped = _ray_cli("stop", "--force", env=env)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        deadline = time.monotonic() + 10
        while _listening(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(port), f"the Ray head still listens on 127.0.0.1:{port} after ray stop"


@pytest.fixture
def on_head(ray_head, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    yield ray_head
    assert not ray.is_initialized(), "the executor stayed connected to Ray after shutdown"


def test_ray_executor_passes_its_suite_on_a_ray_head(on_head):
    """``modelrunner check ray``'s checks: TP=2 through a Ray actor gives one process's greedy tokens."""
    from modelrunner_kit.conformance import suite

    results = {r.check: (r.status, r.message) for r in suite("executors", "ray").run()}
    assert results["runs-like-one-process"] == ("passed", "3 requests, tensor_parallel_size=2"), results
    assert results["refuses-what-it-cannot-run"][0] == "skipped", results


def test_tp2_through_a_ray_actor_matches_one_process_and_a_killed_actor_fails_its_rank(on_head, tiny_llama):
    """The parallel tests' workload (continuous batching, chunked prefill, a fork's block copies) under
    TP=2 with rank 1 a Ray actor: one process's tokens and logits; then the actor is killed."""
    expected = run_workload(LLM(str(tiny_llama), **LLM_KW))
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="ray", **LLM_KW)
    try:
        got = run_workload(llm)
        assert got["tokens"] == expected["tokens"]
        assert (got["logits"] - expected["logits"]).abs().max().item() <= 1e-4
        placed = llm.stats()["parallel"]["ray"][1]
        rank1 = llm.runner.workers.processes[1]
        assert placed["pid"] == rank1.pid != os.getpid()
        with open(f"/proc/{rank1.pid}/cmdline", "rb") as f:
            assert b"ray::RankActor" in f.read()  # rank 1 is the Ray actor's process, not one we spawned

        ray.kill(rank1.actor)
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"rank 1 \(tensor-parallel rank 1.*its Ray actor ended") as e:
            llm.generate(PROMPTS[:2], params, use_tqdm=False)
        assert time.monotonic() - start < REPORT_WITHIN_S
        assert e.value.rank == 1
    finally:
        llm.shutdown()
