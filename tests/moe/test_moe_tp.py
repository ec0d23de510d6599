"""Expert parallelism over two gloo processes: each rank loads half the experts, logits equal transformers'."""

from __future__ import annotations

import pytest
import torch

from modelrunner.parallel_state import ParallelState
from modelrunner_kit.testing import PagedDriver, load_adapter

from gloo_ranks import run_ranks

from .checkpoints import make_config, make_reference, save_checkpoint

PROMPTS = {0: [5, 9, 2, 77, 31, 8, 100], 1: [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]}
ARCHITECTURES = ("qwen2_moe", "qwen3_moe")
"""Qwen2-MoE: experts split plus a tensor-parallel shared expert and dense layer; Qwen3-MoE: q/k norm."""


def _worker(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    parallel = ParallelState(tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD)
    for name in ARCHITECTURES:
        model = load_adapter(f"{root}/{name}", parallel=parallel)
        experts = model.loaded.model.moe_layers[0][1].experts
        assert (experts.num_local_experts, experts.expert_start) == (4, 4 * rank)
        driver = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=32)
        prefill = driver.step(PROMPTS, all_logits=True)
        decode = driver.step({0: [11], 1: [12]}, all_logits=True)
        if rank == 0:
            torch.save({"prefill": prefill, "decode": decode}, f"{root}/{name}.pt")


def test_two_rank_expert_parallel_matches_transformers(tmp_path):
    references = {}
    for name in ARCHITECTURES:
        references[name] = make_reference(make_config(name))
        save_checkpoint(references[name], tmp_path / name)
    run_ranks(_worker, 2, str(tmp_path / "rendezvous"), str(tmp_path))
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
    model = load_adapter(path)
    assert model.parallelize(ParallelState()) is model.loaded
    with pytest.raises(ValueError, match="loaded for tensor-parallel rank 0/1.*called for 1/2"):
        model.parallelize(ParallelState(tp_rank=1, tp_size=2))
