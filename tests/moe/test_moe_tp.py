"""Expert parallelism over two gloo processes: each rank loads half the experts, logits equal transformers'."""

from __future__ import annotations

import pytest
import torch

import modelrunner_moe
from modelrunner.config import CacheConfig, RunnerConfig
from modelrunner.parallel_state import ParallelState
from modelrunner.source import resolve_source

from llama.paged_driver import PagedDriver

from .checkpoints import make_config, make_reference, save_checkpoint

PROMPTS = {0: [5, 9, 2, 77, 31, 8, 100], 1: [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]}
ARCHITECTURES = ("qwen2_moe", "qwen3_moe")
"""Qwen2-MoE: experts split plus a tensor-parallel shared expert and dense layer; Qwen3-MoE: q/k norm."""


def _worker(rank: int, world: int, init_file: str, root: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        parallel = ParallelState(tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD)
        for name in ARCHITECTURES:
            loaded = modelrunner_moe.load(source=resolve_source(f"{root}/{name}"),
                                          config=RunnerConfig(cache=CacheConfig(block_size=4)),
                                          device=torch.device("cpu"), dtype=torch.float32, parallel=parallel)
            loaded = modelrunner_moe.parallelize(loaded=loaded, parallel=parallel)
            experts = loaded.model.moe_layers[0][1].experts
            assert (experts.num_local_experts, experts.expert_start) == (4, 4 * rank)
            driver = PagedDriver(lambda b, kv: modelrunner_moe.forward(loaded=loaded, batch=b, kv_caches=kv).logits,
                                 loaded.kv_cache_spec, num_blocks=32)
            prefill = driver.step(PROMPTS, all_logits=True)
            decode = driver.step({0: [11], 1: [12]}, all_logits=True)
            if rank == 0:
                torch.save({"prefill": prefill, "decode": decode}, f"{root}/{name}.pt")
        dist.barrier()  # both ranks done before either tears gloo down (else a peer can abort)
    finally:
        dist.destroy_process_group()


def test_two_rank_expert_parallel_matches_transformers(tmp_path):
    references = {}
    for name in ARCHITECTURES:
        references[name] = make_reference(make_config(name))
        save_checkpoint(references[name], tmp_path / name)
    torch.multiprocessing.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2)
    for name, reference in references.items():
        got = torch.load(tmp_path / f"{name}.pt")
        with torch.no_grad():
            full = {i: reference(torch.tensor([p + [11 + i]])).logits[0] for i, p in PROMPTS.items()}
        diff = max((got["prefill"] - torch.cat([full[i][:-1] for i in PROMPTS])).abs().max().item(),
                   (got["decode"] - torch.stack([full[i][-1] for i in PROMPTS])).abs().max().item())
        print(f"{name} tp=2: max |logits - transformers| = {diff:.2e}")
        assert diff <= 1e-4


def test_parallelize_rejects_a_different_rank(tmp_path):
    path = save_checkpoint(make_reference(make_config("mixtral")), tmp_path)
    loaded = modelrunner_moe.load(source=resolve_source(str(path)), config=RunnerConfig(),
                                  device=torch.device("cpu"), dtype=torch.float32, parallel=ParallelState())
    assert modelrunner_moe.parallelize(loaded=loaded, parallel=ParallelState()) is loaded
    with pytest.raises(ValueError, match="loaded for tensor-parallel rank 0/1.*called for 1/2"):
        modelrunner_moe.parallelize(loaded=loaded, parallel=ParallelState(tp_rank=1, tp_size=2))
