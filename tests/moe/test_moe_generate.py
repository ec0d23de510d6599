"""Through the public API: greedy generation under continuous batching, router logits, expert statistics."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from modelrunner import LLM, SamplingParams

from .checkpoints import CONFIGS, make_config, make_reference, save_checkpoint

PROMPT_LENGTHS = (3, 17, 8, 30, 5)
MAX_TOKENS = (6, 10, 4, 8, 12)


@pytest.fixture(scope="module", params=list(CONFIGS))
def moe_checkpoint(request, tmp_path_factory, smollm2_tokenizer):
    """``(transformers reference, checkpoint dir with SmolLM2's tokenizer)`` for each architecture."""
    tok = smollm2_tokenizer
    config = make_config(request.param, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    reference = make_reference(config)
    return reference, save_checkpoint(reference, tmp_path_factory.mktemp(request.param), tokenizer=tok)


@pytest.fixture(scope="module")
def llm(moe_checkpoint):
    # Three sequences at a time and 16 tokens a step: prompts queue, join as others finish, and the
    # long ones prefill in chunks next to running decodes.
    return LLM(model=str(moe_checkpoint[1]), dtype="float32", kv_cache_memory=2**20, max_model_len=128,
               block_size=4, max_num_seqs=3, max_num_batched_tokens=16)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_greedy_continuations_match_transformers_under_continuous_batching(llm, moe_checkpoint):
    reference, _ = moe_checkpoint
    prompts = _prompts(reference.config.vocab_size)
    before = llm.runner.stats()["model"]["expert_token_counts"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, n, out in zip(prompts, MAX_TOKENS, outputs):
        # No EOS stop and no EOS suppression on the reference side either, like ignore_eos.
        greedy = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), generation_config=greedy)[0, len(prompt):]
        assert out.outputs[0].token_ids == expected.tolist()
    # Routing reads tensor values, which a recorded graph would freeze: MoE decode steps stay eager.
    assert "is not declared graph-safe" in llm.runner.stats()["compile"]["decode_graphs"]["off"]

    # Every token the model ran (prompts, and each generated token but the last) was routed top_k times.
    stats = llm.runner.stats()["model"]
    ran = sum(PROMPT_LENGTHS) + sum(n - 1 for n in MAX_TOKENS)
    for old, new in zip(before, stats["expert_token_counts"]):
        assert sum(new) - sum(old) == ran * stats["top_k"]
    assert len(stats["expert_token_counts"]) == len(stats["moe_layers"]) >= 1


def test_runner_forward_returns_router_logits(llm, moe_checkpoint):
    reference, _ = moe_checkpoint
    ids = torch.tensor(_prompts(reference.config.vocab_size)[2:3] * 2)  # [2, 8]
    out = llm.runner.forward(ids, return_router_logits=True)
    with torch.no_grad():
        expected = reference(ids, output_router_logits=True)
    assert (out["logits"] - expected.logits).abs().max().item() <= 1e-4
    assert len(out["router_logits"]) == len(expected.router_logits)
    for ours, theirs in zip(out["router_logits"], expected.router_logits):
        assert ours.shape == (2, 8, llm.runner.loaded.model.spec.num_experts)
        assert (ours.reshape(16, -1) - theirs).abs().max().item() <= 1e-5
    plain = llm.runner.forward(ids)
    assert torch.equal(plain, out["logits"])
