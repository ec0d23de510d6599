"""Logits that cannot be sampled honestly — NaN or +inf, a non-float dtype, a column too few or too
many — fail the request they belong to, naming who produced them and what was wrong; the other
requests of the batch go on with the tokens they get alone."""

from __future__ import annotations

import re

import pytest
import torch

from modelrunner import SamplingParams
from modelrunner.engine import LLMEngine
from modelrunner.forward_batch import ForwardOutput

from conftest import VOCAB, FakeRunner
from engine_steps import drain

SAMPLED = dict(temperature=0.8, seed=11, max_tokens=5, ignore_eos=True)
GREEDY = dict(temperature=0.0, max_tokens=5, ignore_eos=True)

BREAKERS = {
    "nan": (lambda row: row * float("nan"), r"NaN in \d+ of 64 logits"),
    "posinf": (lambda row: row.index_fill(-1, torch.tensor([3]), float("inf")), r"\+inf in 1 of 64 logits"),
    "int64": (lambda row: row.long(), r"int64 logits, expected (float32|a floating-point dtype)"),
    "short": (lambda row: row[..., :-1], r"shape \((\d+, )?63,?\), expected \((\d+, )?64,?\)"),
    "long": (lambda row: torch.cat([row, row[..., :1]], -1), r"shape \((\d+, )?65,?\), expected \((\d+, )?64,?\)"),
}




def _alone(params: SamplingParams) -> list[int]:
    engine = LLMEngine(FakeRunner())
    engine.add_request("alone", [4, 5, 6], params)
    return drain(engine)["alone"].outputs[0].token_ids


def _run_beside_a_good_request(bad: SamplingParams, good: SamplingParams, runner: FakeRunner | None = None) -> dict:
    runner = runner or FakeRunner()
    engine = LLMEngine(runner)
    engine.add_request("bad", [1, 2, 3], bad)
    engine.add_request("good", [4, 5, 6], good)
    done = drain(engine)
    assert runner.allocator.stats().used_blocks == 0
    return done


@pytest.mark.parametrize("kind", sorted(BREAKERS))
@pytest.mark.parametrize("sampling", [SAMPLED, GREEDY], ids=["t0.8", "greedy"])
def test_a_registered_processor_returning_bad_logits_fails_only_its_request(kind, sampling, monkeypatch):
    import modelrunner_banned_words

    breaker, message = BREAKERS[kind]
    apply = modelrunner_banned_words.BannedWords.apply
    monkeypatch.setattr(modelrunner_banned_words.BannedWords, "apply",
                        lambda self, logits, rows: breaker(apply(self, logits, rows)))
    bad = SamplingParams(**sampling, logits_processors=[("banned_words", {"token_ids": [9]})])
    done = _run_beside_a_good_request(bad, SamplingParams(**sampling))
    assert done["bad"].outputs[0].finish_reason == "error" and done["bad"].outputs[0].token_ids == []
    assert "logits processor 'banned_words' failed: returned " in done["bad"].error
    assert re.search(message, done["bad"].error), done["bad"].error
    assert done["good"].error is None
    assert done["good"].outputs[0].token_ids == _alone(SamplingParams(**sampling))


@pytest.mark.parametrize("kind", sorted(BREAKERS))
def test_a_vllm_callable_returning_bad_logits_fails_only_its_request(kind):
    breaker, message = BREAKERS[kind]

    def breaks_logits(output_ids, row):
        return breaker(row)

    done = _run_beside_a_good_request(SamplingParams(**SAMPLED, logits_processors=[breaks_logits]),
                                      SamplingParams(**SAMPLED))
    assert done["bad"].outputs[0].finish_reason == "error" and done["bad"].outputs[0].token_ids == []
    assert "logits processor 'breaks_logits' returned " in done["bad"].error
    assert re.search(message, done["bad"].error), done["bad"].error
    assert done["good"].outputs[0].token_ids == _alone(SamplingParams(**SAMPLED))


class _BrokenModel(FakeRunner):
    """Its forward returns logits broken the way ``breaker`` breaks them."""

    breaker = None

    def execute_model(self, batch) -> ForwardOutput:
        out = super().execute_model(batch)
        return ForwardOutput(logits=self.breaker(out.logits))


@pytest.mark.parametrize("kind", ["int64", "short", "long"])
def test_model_logits_of_the_wrong_dtype_or_width_are_refused_not_sampled(kind):
    breaker, message = BREAKERS[kind]
    runner = _BrokenModel()
    runner.breaker = breaker
    engine = LLMEngine(runner)
    engine.add_request("r", [1, 2, 3], SamplingParams(**GREEDY))
    out = drain(engine)["r"]
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    assert out.error.startswith("the model returned ") and re.search(message, out.error), out.error
    assert all(t < VOCAB for t in out.outputs[0].token_ids)
    assert runner.allocator.stats().used_blocks == 0
