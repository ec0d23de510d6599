"""``LLM(data_parallel_size=2)``: two replica processes behind one front; the same greedy tokens as
one engine, in the prompts' order; a hung replica is failed after ``MODELRUNNER_DIST_TIMEOUT`` while
the other serves on; nothing left running after shutdown."""

from __future__ import annotations

import os
import signal
import time

import pytest

from plugin_dists import hide_distribution

from .conftest import children, wait_for_no_children

CONFIG = dict(dtype="float32", compile=False, max_model_len=128)
HUNG_TIMEOUT_S = 4


def test_offline_dp2_equals_dp1_in_order_and_a_hung_replica_fails_alone(tiny_llama, monkeypatch):
    from modelrunner import LLM, SamplingParams
    from modelrunner_data_parallel import DataParallelLLM, ReplicaFailedError

    monkeypatch.setenv("MODELRUNNER_DIST_TIMEOUT", str(HUNG_TIMEOUT_S))
    prompts = [[1, 5 + i, 9, 17 + 3 * i] for i in range(12)]
    params = SamplingParams(max_tokens=6, temperature=0)
    llm = LLM(str(tiny_llama), data_parallel_size=2, **CONFIG)
    assert isinstance(llm, DataParallelLLM) and isinstance(llm, LLM)
    try:
        started = [p for p in children() if "modelrunner_data_parallel.replica" in " ".join(p.cmdline())]
        assert len(started) == 2
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [r.served for r in llm.router.replicas] == [6, 6]  # balanced by load
        with pytest.raises(ValueError, match=r"^prompt 1: .*not in the vocabulary"):
            llm.generate([[1, 2], [1, 99999]], params, use_tqdm=False)
        stats = llm.stats()["data_parallel"]
        assert [r["rank"] for r in stats["replicas"]] == [0, 1] and stats["failed"] == []

        served_before = llm.router.replicas[0].served
        hung = llm.router.replicas[1]
        os.kill(hung.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while not llm.router.failures and time.monotonic() - stopped < 3 * HUNG_TIMEOUT_S:
            time.sleep(0.05)
        assert HUNG_TIMEOUT_S - 0.5 < time.monotonic() - stopped < HUNG_TIMEOUT_S + 3
        (failure,) = llm.router.failures
        assert isinstance(failure, ReplicaFailedError) and failure.rank == 1
        assert f"replica 1 (pid {hung.pid}" in str(failure) and "MODELRUNNER_DIST_TIMEOUT" in str(failure)
        assert hung.process.wait(5) == -signal.SIGKILL  # killed, not restarted
        again = llm.generate(prompts[:2], params, use_tqdm=False)  # the survivor serves
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs[:2]]
        # At least these two (the refused call's first prompt may be counted late, when its abort lands).
        assert llm.router.replicas[0].served >= served_before + 2
    finally:
        llm.shutdown()
    assert llm.router.replicas[0].process.returncode == 0  # left when told to, not killed
    assert wait_for_no_children() == []
    one = LLM(str(tiny_llama), **CONFIG)
    try:
        expected = one.generate(prompts, params, use_tqdm=False)
    finally:
        one.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert [o.prompt_token_ids for o in outputs] == prompts


def test_the_kernel_finds_data_parallelism_through_its_entry_point(monkeypatch):
    """``LLM`` builds the class ``modelrunner-data-parallel`` declares; without that distribution,
    ``data_parallel_size > 1`` says what to install (and one engine never looks)."""
    import modelrunner.llm as kernel_llm
    from modelrunner import ModelRunnerError
    from modelrunner_data_parallel import DataParallelLLM

    assert kernel_llm.data_parallel_llm() is DataParallelLLM
    hide_distribution(monkeypatch, "modelrunner-data-parallel")
    with pytest.raises(ModelRunnerError, match=r"^data_parallel_size > 1 needs the modelrunner-data-parallel "
                                               r"distribution: pip install modelrunner-data-parallel$"):
        kernel_llm.LLM("never-loaded", data_parallel_size=2)


def test_dp_options_are_no_longer_refused_and_bad_values_name_themselves():
    from modelrunner.config import RunnerConfig

    cfg = RunnerConfig.from_dict({"model": "m", "data_parallel_size": 2, "distributed_executor_backend": "mp"})
    assert cfg.parallel.data_parallel_size == 2
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer, got 0"):
        RunnerConfig.from_dict({"model": "m", "data_parallel_size": 0})
    with pytest.raises(ValueError, match="data_parallel_rpc_port must be an integer from 0 to 65535"):
        RunnerConfig.from_dict({"model": "m", "data_parallel_rpc_port": 70000})


def test_lora_adapters_are_read_by_every_replica_and_give_one_engines_tokens(tiny_llama, tmp_path):
    from modelrunner import LLM, LoRARequest, SamplingParams
    from peft_adapters import save_peft_adapter

    adapters = [LoRARequest(f"a{i}", i + 1, str(save_peft_adapter(tiny_llama, tmp_path / f"a{i}", seed=i + 1)))
                for i in range(2)]
    prompts = [[1, 5 + i, 9, 17 + 3 * i] for i in range(8)]
    loras = [adapters[0], adapters[1], None, adapters[0], adapters[1], None, adapters[0], adapters[1]]
    params = SamplingParams(max_tokens=6, temperature=0)
    kw = dict(CONFIG, enable_lora=True, max_loras=2, max_lora_rank=8)
    llm = LLM(str(tiny_llama), data_parallel_size=2, **kw)
    try:
        with pytest.raises(ValueError, match=r"missing"):
            llm.add_lora(LoRARequest("bad", 9, str(tmp_path / "missing")))
        llm.add_lora(adapters[0])  # read now on both; adapters[1] is read where a request first uses it
        outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        replicas = llm.stats()["data_parallel"]["replicas"]
        assert [r["served"] for r in replicas] == [4, 4]
        assert all(r["lora"]["adapters"] == 2 for r in replicas), [r["lora"] for r in replicas]
        assert llm.remove_lora(adapters[0].lora_int_id) is True
    finally:
        llm.shutdown()
    one = LLM(str(tiny_llama), **kw)
    try:
        expected = one.generate(prompts, params, lora_request=loras, use_tqdm=False)
        base = one.generate(prompts[:2], params, use_tqdm=False)
    finally:
        one.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].token_ids for o in outputs[:2]] != [o.outputs[0].token_ids for o in base]  # deltas applied
