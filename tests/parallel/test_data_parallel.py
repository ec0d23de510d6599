"""``LLM(data_parallel_size=2)``: two replica processes behind one front; the same greedy tokens as
one engine, in the prompts' order, and nothing left running after shutdown."""

from __future__ import annotations

import pytest

from .conftest import children, wait_for_no_children

CONFIG = dict(dtype="float32", compile=False, max_model_len=128)


def test_offline_dp2_equals_dp1_in_order_and_shuts_down_cleanly(tiny_llama):
    from modelrunner import LLM, SamplingParams
    from modelrunner.data_parallel import DataParallelLLM

    prompts = [[1, 5 + i, 9, 17 + 3 * i] for i in range(12)]
    params = SamplingParams(max_tokens=6, temperature=0)
    llm = LLM(str(tiny_llama), data_parallel_size=2, **CONFIG)
    assert isinstance(llm, DataParallelLLM) and isinstance(llm, LLM)
    try:
        started = [p for p in children() if "modelrunner.data_parallel.replica" in " ".join(p.cmdline())]
        assert len(started) == 2
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [r.served for r in llm.router.replicas] == [6, 6]  # balanced by load
        with pytest.raises(ValueError, match=r"^prompt 1: .*not in the vocabulary"):
            llm.generate([[1, 2], [1, 99999]], params, use_tqdm=False)
        stats = llm.stats()["data_parallel"]
        assert [r["rank"] for r in stats["replicas"]] == [0, 1] and stats["failed"] == []
    finally:
        llm.shutdown()
    assert [r.process.returncode for r in llm.router.replicas] == [0, 0]  # each left when told to, not killed
    assert wait_for_no_children() == []
    one = LLM(str(tiny_llama), **CONFIG)
    try:
        expected = one.generate(prompts, params, use_tqdm=False)
    finally:
        one.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert [o.prompt_token_ids for o in outputs] == prompts


def test_dp_options_are_no_longer_refused_and_bad_values_name_themselves():
    from modelrunner.config import RunnerConfig

    cfg = RunnerConfig.from_dict({"model": "m", "data_parallel_size": 2, "distributed_executor_backend": "mp"})
    assert cfg.parallel.data_parallel_size == 2
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer, got 0"):
        RunnerConfig.from_dict({"model": "m", "data_parallel_size": 0})
    with pytest.raises(ValueError, match="data_parallel_rpc_port must be an integer from 0 to 65535"):
        RunnerConfig.from_dict({"model": "m", "data_parallel_rpc_port": 70000})


def test_a_hung_replica_is_failed_after_the_timeout_and_the_other_serves_on(tiny_llama, monkeypatch):
    import os
    import signal
    import time

    from modelrunner import LLM, SamplingParams
    from modelrunner.data_parallel import ReplicaFailedError

    monkeypatch.setenv("MODELRUNNER_DIST_TIMEOUT", "3")
    llm = LLM(str(tiny_llama), data_parallel_size=2, **CONFIG)
    try:
        hung = llm.router.replicas[1]
        os.kill(hung.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while not llm.router.failures and time.monotonic() - stopped < 10:
            time.sleep(0.05)
        assert 2.5 < time.monotonic() - stopped < 6
        (failure,) = llm.router.failures
        assert isinstance(failure, ReplicaFailedError) and failure.rank == 1
        assert f"replica 1 (pid {hung.pid}" in str(failure) and "MODELRUNNER_DIST_TIMEOUT" in str(failure)
        assert hung.process.wait(5) == -signal.SIGKILL  # killed, not restarted
        outputs = llm.generate([[1, 5, 9], [1, 6, 9]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3]
        assert llm.router.replicas[0].served == 2
    finally:
        llm.shutdown()
    assert wait_for_no_children() == []
