"""Tensor parallelism over two gloo processes: each rank loads its shard, logits equal transformers'."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from modelrunner.parallel_state import ParallelState
from modelrunner_kit.testing import PagedDriver, load_adapter

from gloo_ranks import run_ranks

PROMPTS = {0: [5, 9, 2, 77, 31, 8, 100], 1: [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]}


def _worker(rank: int, world: int, checkpoint: str, out: str) -> None:
    import torch.distributed as dist

    parallel = ParallelState(tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD)
    model = load_adapter(checkpoint, parallel=parallel)
    assert model.loaded.adapter == "llama" and model.loaded.kv_cache_spec.num_kv_heads == 1
    driver = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=32)
    prefill = driver.step(PROMPTS, all_logits=True)
    decode = driver.step({0: [11], 1: [12]}, all_logits=True)
    if rank == 0:
        torch.save({"prefill": prefill, "decode": decode}, out)


def test_two_rank_tensor_parallel_matches_transformers(tmp_path):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=127, max_position_embeddings=64, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference.save_pretrained(str(tmp_path / "ckpt"))
    out = tmp_path / "logits.pt"
    run_ranks(_worker, 2, str(tmp_path / "rendezvous"), str(tmp_path / "ckpt"), str(out))
    got = torch.load(out)
    with torch.no_grad():
        full = {i: reference(torch.tensor([p + [11 + i]])).logits[0] for i, p in PROMPTS.items()}
    expected_prefill = torch.cat([full[i][:-1] for i in PROMPTS])
    expected_decode = torch.stack([full[i][-1] for i in PROMPTS])
    diff = max((got["prefill"] - expected_prefill).abs().max().item(), (got["decode"] - expected_decode).abs().max().item())
    print(f"tp=2: max |logits - transformers| = {diff:.2e}")
    assert diff <= 1e-4


def test_parallelize_rejects_a_different_rank(tiny_llama_dir):
    model = load_adapter(tiny_llama_dir)
    assert model.parallelize(ParallelState()) is model.loaded
    with pytest.raises(ValueError, match="loaded for tensor-parallel rank 0/1.*called for 1/2"):
        model.parallelize(ParallelState(tp_rank=1, tp_size=2))
