"""Continuous batching is exact: any interleaving gives each request what it gets alone.

These run the engine on the model-free FakeRunner (conftest.py), whose logits depend on the
context read back through the KV cache's block tables, so paging mistakes change the tokens.
"""

from __future__ import annotations

import random

from modelrunner.engine import LLMEngine, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(count: int, seed: int = 0, low: int = 3, high: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 64) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def _drain(engine: LLMEngine) -> dict[str, object]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _alone(fake_runner, prompt, params, **runner_kw):
    engine = LLMEngine(fake_runner(**runner_kw))
    engine.add_request("x", prompt, params)
    return _drain(engine)["x"].outputs


def test_mixed_batch_matches_each_prompt_alone(fake_runner):
    prompts = _prompts(8)
    params = [SamplingParams(max_tokens=4 + 3 * i, **GREEDY) for i in range(8)]
    expected = [_alone(fake_runner, p, sp)[0].token_ids for p, sp in zip(prompts, params)]

    runner = fake_runner()
    engine = LLMEngine(runner)
    for i in range(5):
        engine.add_request(str(i), prompts[i], params[i])
    done = {}
    steps = 0
    while engine.has_unfinished_requests() or steps < 3:
        if steps == 2:  # requests arriving while others decode
            for i in range(5, 8):
                engine.add_request(str(i), prompts[i], params[i])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    assert [done[str(i)].outputs[0].token_ids for i in range(8)] == expected
    assert [len(done[str(i)].outputs[0].token_ids) for i in range(8)] == [4 + 3 * i for i in range(8)]
    assert all(done[str(i)].outputs[0].finish_reason == "length" for i in range(8))
    assert any(b.num_seqs > 1 and not b.is_decode_only for b in runner.batches)  # prefill + decode mixed
    assert runner.allocator.stats().used_blocks == 0


def test_preemption_under_a_tiny_kv_budget_is_exact(fake_runner):
    prompts = _prompts(6, seed=1, low=6, high=12)
    params = SamplingParams(max_tokens=24, **GREEDY)
    expected = [_alone(fake_runner, p, params)[0].token_ids for p in prompts]

    runner = fake_runner(num_blocks=20, block_size=4)  # 80 slots for 6 × ~33 tokens
    engine = LLMEngine(runner)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = _drain(engine)
    assert engine.scheduler.num_preemptions > 0
    assert [done[str(i)].outputs[0].token_ids for i in range(6)] == expected
    stats = runner.allocator.stats()
    assert stats.used_blocks == 0 and stats.peak_used_blocks <= 20


def test_long_prompts_are_prefilled_in_chunks(fake_runner):
    prompts = _prompts(3, seed=2, low=25, high=40)
    params = SamplingParams(max_tokens=5, **GREEDY)
    expected = [_alone(fake_runner, p, params)[0].token_ids for p in prompts]

    runner = fake_runner(max_num_batched_tokens=8)
    engine = LLMEngine(runner)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = _drain(engine)
    assert [done[str(i)].outputs[0].token_ids for i in range(3)] == expected
    assert all(b.num_tokens <= 8 for b in runner.batches)
    assert any(int(b.context_lens.max()) > 0 and b.max_query_len > 1 for b in runner.batches)


def test_max_num_seqs_caps_each_step(fake_runner):
    runner = fake_runner(max_num_seqs=3)
    engine = LLMEngine(runner)
    for i, p in enumerate(_prompts(7, seed=3)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=6, **GREEDY))
    done = _drain(engine)
    assert len(done) == 7
    assert max(b.num_seqs for b in runner.batches) == 3


def test_prefix_cache_hits_are_not_recomputed(fake_runner):
    shared = list(range(1, 21))
    prompts = [shared + [30 + i, 40 + i] for i in range(4)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    expected = [_alone(fake_runner, p, params)[0].token_ids for p in prompts]

    runner = fake_runner()
    engine = LLMEngine(runner)
    engine.add_request("first", prompts[0], params)
    first = _drain(engine)["first"]
    assert first.num_cached_tokens == 0
    for i in range(1, 4):
        engine.add_request(str(i), prompts[i], params)
    done = _drain(engine)
    assert [first.outputs[0].token_ids] + [done[str(i)].outputs[0].token_ids for i in range(1, 4)] == expected
    assert all(done[str(i)].num_cached_tokens == 20 for i in range(1, 4))
    second_prefill = runner.batches[len(runner.batches) - 6]  # first step after "first" finished
    assert second_prefill.num_tokens == 3 * 2 and second_prefill.context_lens.tolist() == [20, 20, 20]


def test_n_completions_share_the_prompt_blocks(fake_runner):
    prompt = _prompts(1, seed=4, low=10, high=11)[0]
    runner = fake_runner()
    engine = LLMEngine(runner)
    engine.add_request("r", prompt, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True))
    out = _drain(engine)["r"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    prefill_tokens = sum(b.num_tokens for b in runner.batches if b.max_query_len > 1)
    assert prefill_tokens == len(prompt)  # the prompt was computed once
    assert runner.allocator.stats().used_blocks == 0
    # Completion 0 of a seeded n=3 request is the seeded n=1 completion.
    single = _alone(fake_runner, prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True))
    assert single[0].token_ids == out.outputs[0].token_ids


def test_greedy_n_gives_identical_completions(fake_runner):
    engine = LLMEngine(fake_runner())
    engine.add_request("r", [5, 6, 7], SamplingParams(n=2, max_tokens=5, **GREEDY))
    out = _drain(engine)["r"]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


def test_seed_is_independent_of_batch_composition(fake_runner):
    prompt = [3, 1, 4, 1, 5]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=123, ignore_eos=True)
    alone = _alone(fake_runner, prompt, seeded)[0].token_ids

    engine = LLMEngine(fake_runner())
    for i, p in enumerate(_prompts(5, seed=5)):
        engine.add_request(f"other{i}", p, SamplingParams(max_tokens=7, temperature=0.8, ignore_eos=True))
    engine.step()
    engine.add_request("seeded", prompt, seeded)
    assert _drain(engine)["seeded"].outputs[0].token_ids == alone

    other_seed = _alone(fake_runner, prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=124,
                                                            ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_a_lone_sequence_that_fills_the_cache_ends_with_length(fake_runner):
    runner = fake_runner(num_blocks=4, block_size=4, max_model_len=16)
    engine = LLMEngine(runner)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=100, **GREEDY))
    out = _drain(engine)["r"]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 16
    assert runner.allocator.stats().used_blocks == 0


def test_a_long_chunked_prefill_does_not_stall_running_decodes(fake_runner):
    runner = fake_runner(max_num_batched_tokens=8)
    engine = LLMEngine(runner)
    engine.add_request("short", [1, 2, 3], SamplingParams(max_tokens=10, **GREEDY))
    engine.step()
    engine.add_request("long", list(range(1, 50)), SamplingParams(max_tokens=2, **GREEDY))
    done = _drain(engine)
    assert len(done["short"].outputs[0].token_ids) == 10
    short_id = engine.executor.batches[0].seq_ids[0]
    # Every step until "short" finished ran its decode next to a chunk of "long".
    steps_with_short = [b for b in runner.batches[1:] if short_id in b.seq_ids]
    assert len(steps_with_short) == 9
    assert all(b.num_seqs == 2 and b.num_tokens == 8 for b in runner.batches[1:6])
