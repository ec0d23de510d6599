"""Stopping rules, streaming deltas, aborts and bad requests, on the model-free FakeRunner."""

from __future__ import annotations

import pytest

from modelrunner.engine import LLMEngine, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _drain(engine: LLMEngine, collect: list | None = None) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if collect is not None:
                collect.append(out)
            if out.finished:
                done[out.request_id] = out
    return done


def _greedy_text(fake_runner, prompt, max_tokens=12):
    engine = LLMEngine(fake_runner())
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    return _drain(engine)["r"].outputs[0]


def test_stop_string_truncates_and_reports_stop(fake_runner):
    full = _greedy_text(fake_runner, [9, 8, 7])
    pieces = full.text.split(",")
    stop = f"{pieces[3]},{pieces[4]}"  # spans two tokens
    engine = LLMEngine(fake_runner())
    engine.add_request("r", [9, 8, 7], SamplingParams(max_tokens=12, stop=stop, **GREEDY))
    out = _drain(engine)["r"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]
    assert out.token_ids == full.token_ids[:5]


def test_streamed_deltas_add_up_to_the_text_and_never_leak_a_stop_string(fake_runner):
    full = _greedy_text(fake_runner, [1, 2], max_tokens=10)
    stop = full.text.split(",")[6] + ","
    engine = LLMEngine(fake_runner())
    engine.add_request("r", [1, 2], SamplingParams(max_tokens=10, stop=[stop, "zz"], **GREEDY))
    updates: list = []
    final = _drain(engine, updates)["r"]
    deltas = "".join(u.outputs[0].delta_text for u in updates)
    assert deltas == final.outputs[0].text
    assert stop not in deltas
    assert all(u.outputs[0].text == "".join(v.outputs[0].delta_text for v in updates[:k + 1])
               for k, u in enumerate(updates))
    assert sum(len(u.outputs[0].delta_token_ids) for u in updates) == len(final.outputs[0].token_ids)


def test_eos_stops_unless_ignored(fake_runner):
    # Make EOS a token that greedy decoding produces third.
    full = _greedy_text(fake_runner, [4, 4, 4])
    eos = full.token_ids[2]
    runner = fake_runner(eos_token_id=eos)
    runner.tokenizer.eos_token_id = eos
    engine = LLMEngine(runner)
    assert engine.eos_token_ids == {eos}
    engine.add_request("stop", [4, 4, 4], SamplingParams(max_tokens=12, temperature=0.0))
    engine.add_request("go", [4, 4, 4], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    done = _drain(engine)
    stopped = done["stop"].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert stopped.token_ids == full.token_ids[:3]  # EOS kept in token_ids ...
    assert stopped.text == "".join(f"{t}," for t in full.token_ids[:2])  # ... not in the text
    assert done["go"].outputs[0].token_ids == full.token_ids


def test_stop_token_ids_and_min_tokens(fake_runner):
    full = _greedy_text(fake_runner, [7, 7])
    stop_id = full.token_ids[1]
    engine = LLMEngine(fake_runner())
    engine.add_request("a", [7, 7], SamplingParams(max_tokens=12, stop_token_ids=[stop_id], **GREEDY))
    engine.add_request("b", [7, 7], SamplingParams(max_tokens=12, stop_token_ids=[stop_id], min_tokens=4, **GREEDY))
    done = _drain(engine)
    a = done["a"].outputs[0]
    assert a.finish_reason == "stop" and a.stop_reason == stop_id and a.token_ids == full.token_ids[:2]
    b = done["b"].outputs[0]
    assert len(b.token_ids) >= 4 and stop_id not in b.token_ids[:4]


def test_max_tokens_gives_length_and_counts(fake_runner):
    engine = LLMEngine(fake_runner())
    engine.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=3, **GREEDY))
    out = _drain(engine)["r"]
    assert out.outputs[0].finish_reason == "length"
    assert out.num_prompt_tokens == 4 and out.num_generated_tokens == 3


def test_text_prompt_and_prompt_dict(fake_runner):
    engine = LLMEngine(fake_runner())
    engine.add_request("t", "hello", SamplingParams(max_tokens=2, **GREEDY))
    engine.add_request("d", {"prompt_token_ids": [1, 2], "images": ["img"]}, SamplingParams(max_tokens=2, **GREEDY))
    done = _drain(engine)
    assert done["t"].prompt == "hello" and len(done["t"].prompt_token_ids) == 5
    assert done["d"].prompt is None and done["d"].prompt_token_ids == [1, 2]
    assert any("images" in b.extra for b in engine.executor.batches)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", None, "prompt is empty"),
        ([], None, "prompt is empty"),
        (list(range(1, 60)) * 3, None, "max_model_len"),
        ([1, 2, 999], None, "not in the vocabulary"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"n": 0}, "n must be"),
        ([1, 2], {"bogus": 1}, "unknown sampling parameter"),
        (3.5, None, "prompt must be"),
    ],
)
def test_a_bad_request_fails_alone(fake_runner, prompt, params, match):
    runner = fake_runner()
    engine = LLMEngine(runner)
    engine.add_request("good1", [1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    engine.add_request("good2", [3, 2, 1], SamplingParams(max_tokens=4, **GREEDY))
    done = _drain(engine)
    assert sorted(done) == ["good1", "good2"]
    assert all(o.outputs[0].finish_reason == "length" for o in done.values())
    assert runner.allocator.stats().used_blocks == 0


def test_duplicate_request_id_is_rejected(fake_runner):
    engine = LLMEngine(fake_runner())
    engine.add_request("r", [1], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("r", [2], SamplingParams(max_tokens=2))


def test_a_request_that_breaks_the_forward_fails_alone(fake_runner):
    runner = fake_runner()
    runner.fail_on_token = 63
    engine = LLMEngine(runner)
    engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=5, **GREEDY))
    engine.add_request("poison", [1, 63, 3], SamplingParams(max_tokens=5, **GREEDY))
    engine.add_request("good2", [4, 5], SamplingParams(max_tokens=5, **GREEDY))
    done = _drain(engine)
    assert done["poison"].error and "poison" in done["poison"].error
    assert done["poison"].outputs[0].finish_reason == "error"
    assert len(done["good"].outputs[0].token_ids) == 5 and len(done["good2"].outputs[0].token_ids) == 5
    assert runner.allocator.stats().used_blocks == 0


def test_a_failed_forward_leaves_no_prefix_cache_entries_behind(fake_runner):
    runner = fake_runner(block_size=4)
    runner.fail_on_token = 63
    engine = LLMEngine(runner)
    poison = [1, 63, 3, 4, 5, 6, 7, 8, 9]
    engine.add_request("poison", poison, SamplingParams(max_tokens=3, **GREEDY))
    assert _drain(engine)["poison"].outputs[0].finish_reason == "error"
    runner.fail_on_token = None
    # The same prompt again: its blocks were registered but never written, so nothing may be reused
    # (the fake runner raises when a sequence reads a slot no forward wrote).
    engine.add_request("again", poison, SamplingParams(max_tokens=3, **GREEDY))
    again = _drain(engine)["again"]
    assert again.error is None and len(again.outputs[0].token_ids) == 3
    assert again.num_cached_tokens == 0
    engine.add_request("third", poison, SamplingParams(max_tokens=3, **GREEDY))
    assert _drain(engine)["third"].num_cached_tokens == 8  # computed once, reused from then on
    assert runner.allocator.stats().used_blocks == 0


def test_a_cached_prefix_longer_than_a_chunk_is_reused_whole(fake_runner):
    runner = fake_runner(block_size=4, max_num_batched_tokens=8)
    engine = LLMEngine(runner)
    prompt = list(range(1, 31))  # 30 tokens: 4 chunks of at most 8
    engine.add_request("first", prompt, SamplingParams(max_tokens=2, **GREEDY))
    first = _drain(engine)["first"]
    steps_before = len(runner.batches)
    engine.add_request("again", prompt, SamplingParams(max_tokens=2, **GREEDY))
    again = _drain(engine)["again"]
    assert again.num_cached_tokens == 28  # every whole block, not just the first chunk's
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert len(runner.batches) - steps_before == 2  # the last 2 prompt tokens in one step, then 1 decode


def test_abort_frees_blocks_and_reports(fake_runner):
    runner = fake_runner()
    engine = LLMEngine(runner)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("b", [1, 2, 4], SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    assert engine.abort_request("a") and not engine.abort_request("nope")
    done = _drain(engine)
    assert done["a"].outputs[0].finish_reason == "abort"
    assert done["b"].outputs[0].finish_reason == "length"
    assert runner.allocator.stats().used_blocks == 0
    assert runner.batches[-1].finished_seq_ids or runner.batches[-2].finished_seq_ids


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("n", 0, r"n must be an integer >= 1, got 0"),
        ("max_tokens", -3, r"max_tokens must be an integer >= 1 or None, got -3"),
        ("temperature", -0.5, r"temperature must be a finite number >= 0"),
        ("top_k", -2, r"top_k must be a positive integer, or -1 or 0"),
        ("top_p", 1.5, r"top_p must be a number in \(0, 1\]"),
        ("seed", "x", r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\] or None"),
        ("stop", [""], r"stop must be"),
        ("stop_token_ids", [-1], r"stop_token_ids must be"),
        ("ignore_eos", 1, r"ignore_eos must be True or False"),
    ],
)
def test_sampling_params_validation_names_field_and_value(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_sampling_params_normalise_stop():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_a_request_reusing_blocks_of_one_that_failed_in_the_same_step_recomputes_them(fake_runner):
    # "later" hits the prompt block "poison" registered in the same step. The step fails, and so does
    # "poison" alone, so that block's KV is never written: "later" must compute it itself rather
    # than read it (the fake runner raises on reading a slot no forward wrote).
    runner = fake_runner(block_size=4)
    runner.fail_on_token = 63
    engine = LLMEngine(runner)
    engine.add_request("poison", [1, 2, 3, 4, 63, 6], SamplingParams(max_tokens=3, **GREEDY))
    engine.add_request("later", [1, 2, 3, 4, 10, 11], SamplingParams(max_tokens=3, **GREEDY))
    done = _drain(engine)
    assert done["poison"].outputs[0].finish_reason == "error"
    later = done["later"]
    assert later.error is None and later.num_cached_tokens == 4  # the hit happened
    runner.fail_on_token = None
    engine.add_request("alone", [1, 2, 3, 4, 10, 11], SamplingParams(max_tokens=3, **GREEDY))
    assert later.outputs[0].token_ids == _drain(engine)["alone"].outputs[0].token_ids
    assert runner.allocator.stats().used_blocks == 0
