"""A worker that dies or raises: rank 0 names the rank and the reason within seconds, no process is left."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from modelrunner import LLM, ModelSourceError, SamplingParams
from modelrunner.executor import WorkerFailedError

from .conftest import children, wait_for_no_children
from .workload import LLM_KW, PROMPTS

REPORT_WITHIN_S = 20.0
"""A failure must surface this soon (gloo sees a dead peer at once; the collective timeout is minutes)."""

FAULTY_PLUGIN = '''
"""Fails on rank 1 only, as $MODELRUNNER_TEST_FAULT says ("load", or "step:N" for the N-th forward)."""
import os

import torch.distributed as dist

from modelrunner.hookspecs import hookimpl

FAULT = os.environ.get("MODELRUNNER_TEST_FAULT", "")
calls = 0


def _on_rank_1():
    return dist.is_initialized() and dist.get_rank() == 1


@hookimpl(wrapper=True)
def load(source, config, device, dtype, parallel):
    if FAULT == "load" and _on_rank_1():
        raise ValueError(f"injected load failure on pipeline stage {parallel.pp_rank}")
    return (yield)


@hookimpl(wrapper=True)
def forward(loaded, batch, kv_caches):
    global calls
    calls += 1
    if FAULT == f"step:{calls}" and _on_rank_1():
        raise RuntimeError(f"injected fault in step {calls}")
    return (yield)
'''


@pytest.fixture
def faulty_plugin_for_workers(tmp_path: Path, monkeypatch) -> None:
    """A plugin distribution installed now (on ``sys.path``, which spawned workers inherit): workers
    started from now on load it; this process has loaded its plugins already (when another test ran)."""
    (tmp_path / "faulty_plugin.py").write_text(FAULTY_PLUGIN)
    info = tmp_path / "faulty_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faulty-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[modelrunner]\nfaulty = faulty_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def _generate_errors(llm: LLM, max_tokens: int = 60) -> list[str]:
    """The error a failing generate raises: a dead rank is fatal, never one request's failure."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with pytest.raises(WorkerFailedError) as info:
        llm.generate(PROMPTS, params, use_tqdm=False)
    return [str(info.value)]


def test_killed_worker_is_named_and_nothing_is_left(tiny_llama):
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **LLM_KW)
    victim = llm.runner.ranks[1]["pid"]
    killed_at: list[float] = []

    def kill_mid_run() -> None:
        while llm.runner.num_steps < 3:
            time.sleep(0.001)
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_mid_run, daemon=True)
    killer.start()
    errors = _generate_errors(llm)
    reported_after = time.monotonic() - killed_at[0]
    print(f"killed worker reported after {reported_after:.2f} s: {errors[0]}")
    assert errors and all("rank 1 " in e and "SIGKILL" in e for e in errors)
    assert reported_after < REPORT_WITHIN_S
    with pytest.raises(WorkerFailedError, match="rank 1 .*SIGKILL") as info:
        llm.runner.forward(torch.tensor([1, 2, 3]))
    assert info.value.rank == 1
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
    assert wait_for_no_children() == []


def test_worker_that_raises_in_a_step_is_named_with_its_error(tiny_llama, faulty_plugin_for_workers, monkeypatch):
    monkeypatch.setenv("MODELRUNNER_TEST_FAULT", "step:3")
    llm = LLM(str(tiny_llama), pipeline_parallel_size=2, **LLM_KW)
    # The worker loads the entry points installed when it starts, in its own process.
    assert "faulty" in llm.runner.ranks[1]["plugins"]
    started = time.monotonic()
    errors = _generate_errors(llm)
    print(f"raising worker reported after {time.monotonic() - started:.2f} s: {errors[0].splitlines()[0]}")
    assert time.monotonic() - started < REPORT_WITHIN_S
    assert errors and all("rank 1 " in e and "RuntimeError: injected fault in step 3" in e for e in errors)
    assert wait_for_no_children() == []


def test_worker_that_fails_to_load_fails_llm_with_its_error(tiny_llama, faulty_plugin_for_workers, monkeypatch):
    monkeypatch.setenv("MODELRUNNER_TEST_FAULT", "load")
    started = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1 .*while loading the model: ValueError: injected load "
                                                "failure on pipeline stage 1") as info:
        LLM(str(tiny_llama), pipeline_parallel_size=2, **LLM_KW)
    assert info.value.rank == 1
    assert time.monotonic() - started < REPORT_WITHIN_S + 15  # includes starting the worker
    assert wait_for_no_children() == []


def test_unknown_model_fails_before_starting_any_process(tmp_path):
    with pytest.raises(ModelSourceError, match="no such file or directory"):
        LLM(str(tmp_path / "missing"), tensor_parallel_size=2, **LLM_KW)
    assert children() == []


HUNG_TIMEOUT_S = 6
"""``MODELRUNNER_DIST_TIMEOUT`` of the hung-worker tests."""


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp", "pp"])
def test_a_hung_worker_fails_the_step_within_the_timeout(tiny_llama, monkeypatch, sizes):
    monkeypatch.setenv("MODELRUNNER_DIST_TIMEOUT", str(HUNG_TIMEOUT_S))
    llm = LLM(str(tiny_llama), **sizes, **LLM_KW)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # the group works
    victim = llm.runner.ranks[1]["pid"]
    os.kill(victim, signal.SIGSTOP)
    started = time.monotonic()
    try:
        errors = _generate_errors(llm, max_tokens=4)
    finally:
        if psutil.pid_exists(victim):
            os.kill(victim, signal.SIGCONT)
    took = time.monotonic() - started
    print(f"hung worker ({sizes}) reported after {took:.2f} s: {errors[0].splitlines()[0]}")
    assert "rank 1 " in errors[0] and "stopped answering" in errors[0] and "MODELRUNNER_DIST_TIMEOUT" in errors[0]
    assert took < HUNG_TIMEOUT_S + 10
    assert wait_for_no_children() == []
