"""One request cannot make the engine do unbounded work: list-valued sampling fields are refused
past their :class:`~modelrunner.config.RequestLimits` (naming the field, its size and the limit;
a server answers 400), and within the limits a step's work does not grow with their size (counted
in Python line events and element comparisons, never timed)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from modelrunner import SamplingParams
from modelrunner.config import RequestLimits, RunnerConfig
from modelrunner.engine import LLMEngine
from modelrunner.engine.stop_checker import StopStrings
from modelrunner.sampling.builtin import (AllowedTokensProcessor, BadWordsProcessor, LogitBiasProcessor,
                                          MinTokensProcessor)
from modelrunner.sampling.logits_processor import LogitsRow, ProcessorContext

from conftest import VOCAB, FakeRunner, FakeTokenizer
from engine_steps import drain

GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=6)




def _python_lines(fn) -> int:
    """Python line events while ``fn()`` runs (its own work and everything it calls). The garbage
    collector is off meanwhile: a collection would run the finalizers of earlier tests' objects
    inside the count."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    gc.collect()
    gc.disable()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
        gc.enable()
    return count


# -- item 6: limits, refused when the request is added -----------------------------------------

@pytest.mark.parametrize(("field", "value", "message"), [
    ("allowed_token_ids", list(range(VOCAB)) + [1],
     r"allowed_token_ids has 65 entries; the limit is max_allowed_token_ids \(the vocabulary size, 64\)"),
    ("stop_token_ids", [1] * (VOCAB + 1),
     r"stop_token_ids has 65 entries; the limit is max_stop_token_ids \(the vocabulary size, 64\)"),
    ("stop", [f"s{i}" for i in range(129)], r"stop has 129 strings; the limit is max_stop_strings=128"),
    ("stop", ["ok", "x" * 257], r"stop\[1\] has 257 characters; the limit is max_stop_string_chars=256"),
    ("bad_words", [f"w{i}" for i in range(129)], r"bad_words has 129 words; the limit is max_bad_words=128"),
    ("bad_words", ["y" * 257], r"bad_words\[0\] has 257 characters; the limit is max_bad_word_chars=256"),
    ("logits_processors", ["banned_words"] * 17,
     r"logits_processors has 17 entries; the limit is max_logits_processors=16"),
    ("stop_token_ids", [2**64], r"stop_token_ids names token id 18446744073709551616, outside the vocabulary"),
    ("stop_token_ids", [VOCAB], r"stop_token_ids names token id 64, outside the vocabulary \(accepted: 0 … 63\)"),
])
def test_a_field_past_its_limit_is_refused_naming_field_size_and_limit(field, value, message):
    runner = FakeRunner()
    engine = LLMEngine(runner)
    with pytest.raises(ValueError, match=message):
        engine.add_request("big", [1, 2], SamplingParams(**GREEDY, **{field: value}))
    assert not engine.has_unfinished_requests()
    engine.add_request("next", [1, 2], SamplingParams(**GREEDY))
    assert len(drain(engine, 200)["next"].outputs[0].token_ids) == 6
    assert runner.allocator.stats().used_blocks == 0


def test_the_limits_are_settings_of_the_engine_config():
    config = RunnerConfig.from_dict({"model": "fake", "max_logit_bias": 3, "max_stop_strings": 2})
    assert config.limits == RequestLimits(max_logit_bias=3, max_stop_strings=2)
    with pytest.raises(ValueError, match="max_bad_words must be a positive integer, got 0"):
        RunnerConfig.from_dict({"model": "fake", "max_bad_words": 0})
    engine = LLMEngine(FakeRunner(max_logit_bias=3, max_stop_strings=2))
    with pytest.raises(ValueError, match=r"logit_bias has 4 entries; the limit is max_logit_bias=3"):
        engine.add_request("r", [1], SamplingParams(logit_bias={1: 1, 2: 1, 3: 1, 4: 1}))
    with pytest.raises(ValueError, match=r"stop has 3 strings; the limit is max_stop_strings=2"):
        engine.add_request("r", [1], SamplingParams(stop=["a", "b", "c"]))
    engine.add_request("at-the-limits", [1], SamplingParams(**GREEDY, logit_bias={1: 1, 2: 1, 3: 1}, stop=["a", "b"]))
    assert drain(engine, 200)["at-the-limits"].error is None


def test_a_server_answers_an_engine_limit_with_a_400_naming_the_field():
    from modelrunner_serve.async_engine import PromptRejected
    from modelrunner_serve.state import engine_refusal

    engine = LLMEngine(FakeRunner())
    with pytest.raises(ValueError) as refused:
        engine.add_request("r", [1], SamplingParams(allowed_token_ids=list(range(VOCAB)) * 2))
    error = engine_refusal(PromptRejected(0, str(refused.value)), "prompt", 1)
    assert error.status == 400 and error.param == "allowed_token_ids", vars(error)
    assert "the limit is max_allowed_token_ids" in str(error.message)


# -- item 7: per-step work does not grow with the fields' size ---------------------------------

BIG_VOCAB = 50_000


def _apply_lines(processor_cls, small: dict, large: dict, output: list[int]) -> tuple[int, int]:
    """Line events of one ``apply`` for a row of a request with the ``small`` fields and one with the ``large``."""
    processor = processor_cls(ProcessorContext(BIG_VOCAB, FakeTokenizer(), frozenset({0})))
    counts = []
    for fields in (small, large):
        params = SamplingParams(**fields)
        row = LogitsRow(state=processor.request_state(params, {}), params=params, prompt_token_ids=[1, 2],
                        output_token_ids=output)
        logits = torch.zeros(2, BIG_VOCAB)
        processor.apply(logits, [row, row])  # first use may copy the request's tensors to the device
        counts.append(_python_lines(lambda: processor.apply(logits, [row, row])))
    return counts[0], counts[1]


@pytest.mark.parametrize(("processor_cls", "small", "large"), [
    (AllowedTokensProcessor, {"allowed_token_ids": [7]}, {"allowed_token_ids": list(range(BIG_VOCAB))}),
    (LogitBiasProcessor, {"logit_bias": {7: 1.0}}, {"logit_bias": {t: 0.5 for t in range(BIG_VOCAB)}}),
    (MinTokensProcessor, {"min_tokens": 5, "stop_token_ids": [7]},
     {"min_tokens": 5, "stop_token_ids": list(range(1, BIG_VOCAB))}),
    (BadWordsProcessor, {"bad_words": ["ab"]}, {"bad_words": [f"{chr(65 + i % 50)}{i}" for i in range(3000)]}),
])
def test_a_processor_step_does_the_same_python_work_for_one_entry_or_the_whole_vocabulary(processor_cls, small,
                                                                                           large):
    one, many = _apply_lines(processor_cls, small, large, output=[60, 61, 62])  # no bad word's prefix
    assert many <= one + 4, f"{processor_cls.name}: {one} line events for one entry, {many} for {large.keys()}"


def test_stop_strings_are_found_by_walking_the_new_text_not_by_trying_each_string():
    text = "the quick brown fox jumps over the lazy dog" * 3
    few = StopStrings(["never", "nowhere"])
    many = StopStrings(["never", "nowhere", *(f"{i}zz{i}" for i in range(20_000))])
    lines = [_python_lines(lambda m=m: m.find(text, len(text) - 6)) for m in (few, many)]
    assert lines[1] <= lines[0] + 4, lines
    assert many.find(text + "9zz9", len(text)) == (len(text), "9zz9")


def test_stop_strings_match_as_before_earliest_first_then_request_order():
    matcher = StopStrings(["ab", "abc", "bc", "x"])
    assert matcher.find("zzabc", 0) == (2, "ab")
    assert matcher.find("zzabc", 4) == (2, "abc")  # "ab" ended before the new text; "abc" ends in it
    assert matcher.find("zzbc", 3) == (2, "bc")
    assert matcher.find("qq", 0) is None


class _CountedId(int):
    """A token id that counts the equality comparisons made against it."""

    compared = 0

    def __eq__(self, other):
        _CountedId.compared += 1
        return int(self) == other

    __hash__ = int.__hash__


def test_stop_token_ids_are_a_set_lookup_per_step_not_a_scan():
    engine = LLMEngine(FakeRunner())
    stops = [_CountedId(t) for t in range(1, VOCAB)]
    engine.add_request("many-stops", [1, 2], SamplingParams(**GREEDY, stop_token_ids=stops, min_tokens=6))
    engine.step()  # the first token: the request's stop ids are prepared once
    _CountedId.compared = 0
    out = drain(engine, 200)["many-stops"]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 6
    assert _CountedId.compared <= 5, f"{_CountedId.compared} comparisons against stop_token_ids in 5 steps"


def test_an_engine_step_beside_large_fields_does_the_same_python_work_as_beside_small_ones():
    """Whole steps of a greedy victim beside a request at each limit (its output unchanged by them)
    against beside the same request with one entry per field."""
    def steps(fields: dict) -> int:
        engine = LLMEngine(FakeRunner(max_stop_strings=2000, max_bad_words=2000))
        engine.add_request("victim", [1, 2, 3], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12))
        engine.add_request("big", [4, 5], SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, **fields))
        engine.step(), engine.step()
        return _python_lines(lambda: [engine.step() for _ in range(6)])

    small = steps({"allowed_token_ids": [1, 2], "logit_bias": {3: 0.0}, "stop_token_ids": [63],
                   "stop": ["#never"], "bad_words": ["@"]})
    large = steps({"allowed_token_ids": [1, 2] * 32, "logit_bias": {t: 0.0 for t in range(VOCAB)},
                   "stop_token_ids": [63] * VOCAB,
                   "stop": [f"#never{i}" for i in range(2000)], "bad_words": [f"@{i}" for i in range(2000)]})
    assert large <= small * 1.02 + 20, f"{small} line events beside small fields, {large} beside large ones"
