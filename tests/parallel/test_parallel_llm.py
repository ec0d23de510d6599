"""``LLM(..., tensor_parallel_size / pipeline_parallel_size = 2)`` starts its own worker and gives
what one process gives: logits within 1e-4, identical greedy continuations under continuous batching."""

from __future__ import annotations

import os

import pytest

from modelrunner import LLM
from modelrunner.errors import ModelRunnerError

from .conftest import save_tiny_llama, wait_for_no_children
from .workload import LLM_KW, run_workload


def _run_parallel(path, tp: int, pp: int) -> tuple[dict, list[dict]]:
    llm = LLM(str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, **LLM_KW)
    try:
        return run_workload(llm), llm.runner.ranks
    finally:
        llm.runner.shutdown()


def _compare(name: str, got: dict, expected: dict) -> None:
    diff = (got["logits"] - expected["logits"]).abs().max().item()
    print(f"{name}: max |logits - single process| = {diff:.2e}")
    assert diff <= 1e-4
    assert got["tokens"] == expected["tokens"]


@pytest.fixture(scope="module")
def llama_reference(tiny_llama):
    return run_workload(LLM(str(tiny_llama), **LLM_KW))


@pytest.mark.parametrize(("tp", "pp", "layers"), [(2, 1, [2, 2]), (1, 2, [1, 1])], ids=["tp2", "pp2"])
def test_llama_two_ranks_match_one_process(tiny_llama, llama_reference, tp, pp, layers):
    got, ranks = _run_parallel(tiny_llama, tp, pp)
    _compare(f"llama tp={tp} pp={pp}", got, llama_reference)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["pid"] == os.getpid() and ranks[1]["pid"] != os.getpid()
    assert [(r["tp_rank"], r["pp_rank"]) for r in ranks] == ([(0, 0), (1, 0)] if tp == 2 else [(0, 0), (0, 1)])
    assert [r["num_layers"] for r in ranks] == layers
    assert ranks[0]["num_blocks"] == ranks[1]["num_blocks"]
    # The worker loaded the plugins itself, from the same entry points.
    assert "llama" in ranks[1]["plugins"] and ranks[1]["plugins"] == ranks[0]["plugins"]
    assert wait_for_no_children() == []


def test_uneven_pipeline_with_tied_embeddings_agrees_on_kv_blocks(tmp_path, smollm2_tokenizer):
    # 3 layers on 2 stages: stage 0 runs 2, stage 1 runs 1 plus the tied LM head (the embedding's weight).
    path = save_tiny_llama(tmp_path / "ckpt", smollm2_tokenizer, num_layers=3, tie=True)
    expected = run_workload(LLM(str(path), **LLM_KW))
    got, ranks = _run_parallel(path, 1, 2)
    _compare("llama 3 layers, tied, pp=2", got, expected)
    assert [r["num_layers"] for r in ranks] == [2, 1]
    # The same 2 MiB budget fits twice the blocks of one layer; every rank takes the smallest count.
    per_block_per_layer = 2 * 2 * 16 * 4 * LLM_KW["block_size"]  # K+V × kv heads × head dim × fp32 × tokens
    assert [r["num_blocks"] for r in ranks] == [LLM_KW["kv_cache_memory"] // (2 * per_block_per_layer)] * 2
    assert [r["kv_cache_bytes"] for r in ranks] == [LLM_KW["kv_cache_memory"], LLM_KW["kv_cache_memory"] // 2]
    assert wait_for_no_children() == []


@pytest.mark.parametrize(("tp", "pp", "layers"), [(2, 1, [2, 2]), (1, 2, [1, 1])], ids=["tp2", "pp2"])
def test_mixtral_two_ranks_match_one_process(tiny_mixtral, tp, pp, layers):
    expected = run_workload(LLM(str(tiny_mixtral), **LLM_KW))
    got, ranks = _run_parallel(tiny_mixtral, tp, pp)
    _compare(f"mixtral tp={tp} pp={pp}", got, expected)
    assert [r["num_layers"] for r in ranks] == layers
    assert wait_for_no_children() == []


def test_mixtral_pipeline_refuses_router_logits_and_stays_usable(tiny_mixtral):
    llm = LLM(str(tiny_mixtral), pipeline_parallel_size=2, **LLM_KW)
    try:
        with pytest.raises(ModelRunnerError, match=r"return_router_logits needs pipeline_parallel_size=1 \(got 2\)"):
            llm.runner.forward([1, 2, 3], return_router_logits=True)
        single = LLM(str(tiny_mixtral), **LLM_KW).runner.forward([1, 2, 3])
        assert (llm.runner.forward([1, 2, 3]) - single).abs().max().item() <= 1e-4
    finally:
        llm.runner.shutdown()
    assert wait_for_no_children() == []
