"""Beam search on a real engine (a tiny random Llama) with a KV cache of a few blocks: whichever way a
beam search ends (done, out of blocks, a failed forward), it leaves no block held and nothing in the
prefix cache that its forward did not write."""

from __future__ import annotations

import pytest
import torch

from modelrunner import LLM, BeamSearchParams, SamplingParams
from modelrunner.kv_cache.allocator import KVCacheError

BLOCK = 4
MAX_LEN = 64
NUM_BLOCKS = MAX_LEN // BLOCK  # the fewest blocks the engine accepts: one longest sequence
GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 2, 77, 31, 8, 14, 3, 60, 21]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer random Llama over 256 tokens (no tokenizer: prompts are token ids)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                         tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)  # peaked distributions: garbage KV changes the tokens
    path = tmp_path_factory.mktemp("tiny-llama-beams")
    model.save_pretrained(str(path))
    return str(path)


def _llm(checkpoint: str) -> LLM:
    # 2 layers * 2 kv heads * head dim 16 * (k, v) * 4 bytes = 512 bytes a token.
    llm = LLM(checkpoint, device="cpu", block_size=BLOCK, max_model_len=MAX_LEN,
              kv_cache_memory=NUM_BLOCKS * BLOCK * 512)
    assert llm.engine.allocator.num_blocks == NUM_BLOCKS
    # Slots nobody wrote hold large random values instead of zeros, so that reading even one of them
    # (a prefix-cache hit on KV that was never computed) changes the tokens, as stale KV would.
    noise = torch.Generator().manual_seed(1)
    for cache in llm.engine.executor.runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=noise) * 100)
    return llm


@pytest.fixture(scope="module")
def fresh(checkpoint):
    """Greedy token ids of a prompt on an engine that never ran a beam search."""
    llm = _llm(checkpoint)
    return lambda prompt, max_tokens: _greedy(llm, prompt, max_tokens)


def _greedy(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=max_tokens, **GREEDY))
    return out[0].outputs[0].token_ids


def _used(llm: LLM) -> int:
    return llm.engine.allocator.stats().used_blocks


def test_beam_searches_that_run_out_of_blocks_hold_none_afterwards(checkpoint, fresh):
    llm = _llm(checkpoint)
    for i in range(6):
        with pytest.raises(ValueError, match="beam search ran out of KV-cache blocks"):
            llm.beam_search([{"prompt_token_ids": [p + i for p in PROMPT]}],
                            BeamSearchParams(beam_width=6, max_tokens=40, ignore_eos=True))
        assert _used(llm) == 0, f"after failed beam search {i}"
    # The whole cache is free again: a request as long as the cache gets every token it asked for.
    out = _greedy(llm, [7, 7, 7, 7], MAX_LEN - 4)
    assert len(out) == MAX_LEN - 4
    assert out == fresh([7, 7, 7, 7], MAX_LEN - 4)


def test_a_failed_beam_search_leaves_no_unwritten_prefix_in_the_cache(checkpoint, fresh):
    llm = _llm(checkpoint)
    # The second prompt finds no blocks: the first was allocated (its full blocks hashed) but never run.
    long_prompt = [(13 * i + 1) % 256 for i in range(40)]
    with pytest.raises(ValueError, match="ran out of KV-cache blocks"):
        llm.beam_search([{"prompt_token_ids": long_prompt}, {"prompt_token_ids": PROMPT * 3}],
                        BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    assert _used(llm) == 0
    assert _greedy(llm, long_prompt, 8) == fresh(long_prompt, 8)


def test_beams_filling_blocks_in_the_step_that_runs_out_are_not_cached(checkpoint, fresh, monkeypatch):
    llm = _llm(checkpoint)
    alloc, executor = llm.engine.allocator, llm.engine.executor
    # Spies (behaviour unchanged): each beam sequence's tokens with slots, which sequences got a slot
    # since the last forward, and those whose slot filled a block in the step that ran out.
    paths: dict[int, list[int]] = {}
    this_step: set[int] = set()
    filled: list[list[int]] = []
    allocate, fork, append_slots, execute = alloc.allocate, alloc.fork, alloc.append_slots, executor.execute_model

    def spy_allocate(seq_id, tokens, extra_keys=()):
        paths[seq_id] = list(tokens)
        return allocate(seq_id, tokens, extra_keys)

    def spy_fork(parent, child):
        paths[child] = list(paths[parent])
        return fork(parent, child)

    def spy_append(seq_id, tokens):
        try:
            copies = append_slots(seq_id, tokens)
        except KVCacheError:
            filled.extend(paths[s] for s in this_step if s in alloc and len(paths[s]) % BLOCK == 0)
            raise
        paths[seq_id] += tokens
        this_step.add(seq_id)
        return copies

    def spy_execute(batch):
        this_step.clear()
        return execute(batch)

    for obj, name, spy in ((alloc, "allocate", spy_allocate), (alloc, "fork", spy_fork),
                           (alloc, "append_slots", spy_append), (executor, "execute_model", spy_execute)):
        monkeypatch.setattr(obj, name, spy)
    with pytest.raises(ValueError, match="ran out of KV-cache blocks"):
        # Two prompts of different lengths: the first's beams fill blocks in the step where the
        # second's run out (found by trying; the assert below says if that ever stops being so).
        llm.beam_search([{"prompt_token_ids": PROMPT[:2]}, {"prompt_token_ids": PROMPT[::-1][:7]}],
                        BeamSearchParams(beam_width=3, max_tokens=50, ignore_eos=True))
    monkeypatch.undo()
    assert filled, "no beam filled a block in the step that ran out (the test lost its point)"
    assert _used(llm) == 0
    # The filled block's last token was never computed: a prompt extending the beam must not be served it.
    for path in filled:
        assert _greedy(llm, path + [1], 3) == fresh(path + [1], 3), f"prompt {path}"


@pytest.mark.parametrize("fault", [RuntimeError, KeyboardInterrupt])
def test_a_forward_that_raises_mid_search_frees_and_uncaches_everything(checkpoint, fresh, monkeypatch, fault):
    llm = _llm(checkpoint)
    executor = llm.engine.executor
    real = executor.execute_model
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 5:
            raise fault("injected fault")
        return real(batch)

    monkeypatch.setattr(executor, "execute_model", flaky)
    # beam_width=1 is greedy: the step whose forward raises has just filled a block on the greedy path.
    with pytest.raises(fault, match="injected fault"):
        llm.beam_search([{"prompt_token_ids": PROMPT[:4]}], BeamSearchParams(beam_width=1, max_tokens=12,
                                                                            ignore_eos=True))
    monkeypatch.setattr(executor, "execute_model", real)
    assert _used(llm) == 0
    path = PROMPT[:4] + fresh(PROMPT[:4], 8)
    assert _greedy(llm, path, 6) == fresh(path, 6)


def test_a_successful_beam_search_holds_nothing_and_keeps_valid_prefixes(checkpoint, fresh):
    llm = _llm(checkpoint)
    out = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=8,
                                                                           ignore_eos=True))
    assert _used(llm) == 0
    best = out[0].sequences[0].tokens
    assert _greedy(llm, best, 4) == fresh(best, 4)
