"""Tensor parallelism over two gloo processes: each rank loads its shard, logits equal transformers'."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import modelrunner_llama
from modelrunner.config import CacheConfig, RunnerConfig
from modelrunner.loaded_model import LoadedModel
from modelrunner.parallel_state import ParallelState
from modelrunner.source import resolve_source

from .paged_driver import PagedDriver

PROMPTS = {0: [5, 9, 2, 77, 31, 8, 100], 1: [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]}


def _worker(rank: int, world: int, init_file: str, checkpoint: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        parallel = ParallelState(tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD)
        loaded = modelrunner_llama.load(source=resolve_source(checkpoint), config=RunnerConfig(cache=CacheConfig(block_size=4)),
                                        device=torch.device("cpu"), dtype=torch.float32, parallel=parallel)
        loaded = modelrunner_llama.parallelize(loaded=loaded, parallel=parallel)
        assert loaded.kv_cache_spec.num_kv_heads == 1
        driver = PagedDriver(lambda b, kv: modelrunner_llama.forward(loaded=loaded, batch=b, kv_caches=kv),
                             loaded.kv_cache_spec, num_blocks=32)
        prefill = driver.step(PROMPTS, all_logits=True)
        decode = driver.step({0: [11], 1: [12]}, all_logits=True)
        if rank == 0:
            torch.save({"prefill": prefill, "decode": decode}, out)
        dist.barrier()  # both ranks done before either tears gloo down (else a peer can abort)
    finally:
        dist.destroy_process_group()


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
    torch.multiprocessing.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path / "ckpt"), str(out)),
                                nprocs=2)
    got = torch.load(out)
    with torch.no_grad():
        full = {i: reference(torch.tensor([p + [11 + i]])).logits[0] for i, p in PROMPTS.items()}
    expected_prefill = torch.cat([full[i][:-1] for i in PROMPTS])
    expected_decode = torch.stack([full[i][-1] for i in PROMPTS])
    diff = max((got["prefill"] - expected_prefill).abs().max().item(), (got["decode"] - expected_decode).abs().max().item())
    print(f"tp=2: max |logits - transformers| = {diff:.2e}")
    assert diff <= 1e-4


def test_parallelize_rejects_a_different_rank():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        model = modelrunner_llama.LlamaForCausalLM(config, max_position=16)
    loaded = LoadedModel(model=model, tokenizer=None, hf_config=config, kv_cache_spec=None)
    assert modelrunner_llama.parallelize(loaded=loaded, parallel=ParallelState()) is loaded
    with pytest.raises(ValueError, match="loaded for tensor-parallel rank 0/1.*called for 1/2"):
        modelrunner_llama.parallelize(loaded=loaded, parallel=ParallelState(tp_rank=1, tp_size=2))
    other = LoadedModel(model=torch.nn.Linear(1, 1), tokenizer=None, hf_config=config, kv_cache_spec=None)
    assert modelrunner_llama.parallelize(loaded=other, parallel=ParallelState()) is None
