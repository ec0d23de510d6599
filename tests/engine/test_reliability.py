"""No request can wedge the engine or silently get a wrong answer: every failure after the forward
fails only its request, edge sampling values are exact or refused, outputs reach their owner."""

from __future__ import annotations

import pytest

from modelrunner import SamplingParams
from modelrunner.engine import LLMEngine
from modelrunner.engine.beam_search import BeamSearchParams, beam_search
from modelrunner.engine.block_owners import BlockOwnershipError
from modelrunner.kv_cache.paged import PagedBlockAllocator
from modelrunner.plugins import get_plugins

from engine_steps import drain

GREEDY = dict(temperature=0.0, ignore_eos=True)




def _solo(fake_runner, prompt, params, **runner_kw) -> list[int]:
    engine = LLMEngine(fake_runner(**runner_kw))
    engine.add_request("solo", prompt, params)
    return drain(engine)["solo"].outputs[0].token_ids


def test_a_processor_that_raises_fails_only_its_request_and_nothing_is_held(fake_runner):
    def boom(output_ids, logits):
        raise RuntimeError("boom")

    runner = fake_runner()
    engine = LLMEngine(runner)
    engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=5, logits_processors=[boom], **GREEDY))
    engine.add_request("good", [4, 5, 6], SamplingParams(max_tokens=5, **GREEDY))
    done = drain(engine)
    assert done["bad"].outputs[0].finish_reason == "error"
    assert "logits processor 'callables' failed: RuntimeError: boom" in done["bad"].error
    assert done["good"].outputs[0].token_ids == _solo(fake_runner, [4, 5, 6], SamplingParams(max_tokens=5, **GREEDY))
    assert runner.allocator.stats().used_blocks == 0


def test_top_k_far_above_the_vocabulary_means_all_tokens(fake_runner):
    # 10**19 overflowed int64 in the sampler, after the forward: the step wedged every request in it.
    sampled = dict(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine = LLMEngine(fake_runner())
    engine.add_request("huge", [1, 2], SamplingParams(top_k=10**19, **sampled))
    engine.add_request("other", [3, 4], SamplingParams(max_tokens=6, **GREEDY))
    done = drain(engine)
    assert done["huge"].error is None
    assert done["huge"].outputs[0].token_ids == _solo(fake_runner, [1, 2], SamplingParams(top_k=0, **sampled))


@pytest.mark.parametrize("temperature", [1e-30, 1e-12, 5e-6])
def test_temperatures_below_the_epsilon_are_greedy(fake_runner, temperature):
    got = _solo(fake_runner, [9, 9], SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=3))
    assert got == _solo(fake_runner, [9, 9], SamplingParams(max_tokens=8, **GREEDY))


def test_a_small_temperature_above_the_epsilon_stays_finite(fake_runner):
    params = SamplingParams(temperature=2e-5, max_tokens=8, ignore_eos=True, seed=3)
    assert _solo(fake_runner, [9, 9], params) == _solo(fake_runner, [9, 9], SamplingParams(max_tokens=8, **GREEDY))


def test_nan_logits_fail_their_request_with_a_clear_error(fake_runner):
    runner = fake_runner()
    runner.nan_on_token = 42
    engine = LLMEngine(runner)
    engine.add_request("broken", [1, 42, 3], SamplingParams(max_tokens=4, **GREEDY))
    engine.add_request("fine", [1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    done = drain(engine)
    assert done["broken"].outputs[0].finish_reason == "error" and done["broken"].outputs[0].token_ids == []
    assert "logits for request 'broken' contain NaN or +inf" in done["broken"].error
    assert len(done["fine"].outputs[0].token_ids) == 4 and done["fine"].error is None
    assert runner.allocator.stats().used_blocks == 0


def test_masking_every_token_fails_the_request_instead_of_sampling_garbage(fake_runner):
    engine = LLMEngine(fake_runner())
    params = SamplingParams(max_tokens=3, allowed_token_ids=[5], logit_bias={5: -100}, **GREEDY)
    engine.add_request("r", [1, 2], params)
    out = drain(engine)["r"]
    assert out.outputs[0].finish_reason == "length"  # -100 is a bias, not a mask: token 5 stays sampleable
    assert out.outputs[0].token_ids == [5, 5, 5]
    engine.add_request("masked", [1, 2], SamplingParams(max_tokens=3, allowed_token_ids=[5],
                                                        logits_processors=[lambda ids, row: row - float("inf")],
                                                        **GREEDY))
    out = drain(engine)["masked"]
    assert out.outputs[0].finish_reason == "error" and "every token is excluded" in out.error


@pytest.mark.parametrize(("field", "value", "match"), [
    ("seed", 2**64, r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
    ("seed", -(2**63) - 1, r"seed must be an integer in"),
    ("temperature", float("nan"), r"temperature must be a finite number >= 0"),
    ("temperature", float("inf"), r"temperature must be a finite number >= 0"),
    ("top_p", float("nan"), r"top_p must be a number in \(0, 1\]"),
])
def test_out_of_range_values_are_refused_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})
    params = SamplingParams()
    with pytest.raises(ValueError, match=match):
        setattr(params, field, value)


def test_a_transient_failure_of_a_lone_request_is_retried(fake_runner):
    runner = fake_runner()
    engine = LLMEngine(runner)
    engine.add_request("alone", [1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    runner.fail_next = 1  # the next forward fails once; alone in its step, the request reruns alone
    out = drain(engine)["alone"]
    assert out.error is None and out.outputs[0].token_ids == _solo(fake_runner, [1, 2, 3],
                                                                    SamplingParams(max_tokens=4, **GREEDY))


def test_outputs_of_requests_added_directly_are_kept_for_their_owner(fake_runner):
    engine = LLMEngine(fake_runner())
    engine.add_request("mine", [7, 7, 7], SamplingParams(max_tokens=2, **GREEDY))  # no consumer
    # Another caller drives the same engine to finish its own requests (what LLM.generate does).
    tokens = engine.generate_token_ids([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6, **GREEDY))
    assert [len(t) for t in tokens] == [6, 6]
    assert not engine.is_running("mine")  # it finished meanwhile ...
    kept = engine.step()  # ... and its outputs waited for whoever steps the engine
    assert [o.request_id for o in kept if o.finished] == ["mine"]
    assert kept[-1].outputs[0].token_ids == _solo(fake_runner, [7, 7, 7], SamplingParams(max_tokens=2, **GREEDY))


def test_changing_params_after_adding_does_not_change_the_request(fake_runner):
    engine = LLMEngine(fake_runner())
    params = SamplingParams(max_tokens=3, **GREEDY)
    engine.add_request("r", [1, 2], params)
    params.max_tokens = 9
    assert len(drain(engine)["r"].outputs[0].token_ids) == 3
    params.min_tokens = 20  # each field is checked when set; the rule between them when added
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(9\), got 20"):
        engine.add_request("again", [1, 2], params)


class _HandsOutHeldBlocks(PagedBlockAllocator):
    """The paged allocator, except that every new block is the first block a live sequence holds."""

    name = "hands_out_held"

    def _take_free_block(self) -> int:
        block = super()._take_free_block()
        held = [b for seq in self._seqs.values() for b in seq.block_table]
        return held[0] if held else block


class _WithAllocator:
    """The real plugins, except that every allocator created is ``cls``."""

    def __init__(self, plugins, cls) -> None:
        self._plugins, self._cls = plugins, cls

    def __getattr__(self, name):
        return getattr(self._plugins, name)

    def create_allocator(self, name, num_blocks, block_size, max_model_len, config):
        return self._cls(num_blocks, block_size, max_model_len, config.enable_prefix_caching)


@pytest.mark.parametrize("beams", [False, True])
def test_an_allocator_handing_out_a_held_block_fails_loudly_naming_it(fake_runner, monkeypatch, beams):
    runner = fake_runner()
    monkeypatch.setattr(type(runner), "plugins", property(lambda self: _WithAllocator(get_plugins(),
                                                                                      _HandsOutHeldBlocks)))
    engine = LLMEngine(runner)
    engine.add_request("first", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, **GREEDY))
    if beams:  # a beam search's blocks are checked against the running requests' too
        engine.step()
        with pytest.raises(BlockOwnershipError, match=r"KV allocator 'hands_out_held' \(_HandsOutHeldBlocks\) "
                                                      r"handed out block 0 as a new block to sequence \d+ while "
                                                      r"sequence\(s\) \[0\] hold it"):
            beam_search(engine, [[9, 8, 7]], BeamSearchParams(beam_width=2, max_tokens=3))
        return
    engine.add_request("second", [6, 7, 8], SamplingParams(max_tokens=4, **GREEDY))
    with pytest.raises(BlockOwnershipError, match=r"KV allocator 'hands_out_held' \(_HandsOutHeldBlocks\) handed "
                                                  r"out block 0 as a new block to sequence 1 while sequence\(s\) \[0\] "
                                                  r"hold it"):
        engine.step()
