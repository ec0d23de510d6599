"""A property-based soak of the engine: random requests (edge sampling values included), aborts,
additions and beam searches between steps, a KV cache small enough to preempt (and for beam searches
to run out of blocks), and a runner that fails at random steps (raising, returning a wrong number of
rows, returning NaN). After every step and every beam search nothing is stuck and the used blocks are
exactly those live sequences hold; every greedy or seeded request that finished normally, and every
beam search no fault touched, equals its run alone on a healthy engine (so no beam search, failed or
not, left KV it never wrote in the prefix cache)."""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelrunner import SamplingParams
from modelrunner.engine import LLMEngine
from modelrunner.engine.beam_search import BeamSearchParams, beam_search
from modelrunner.engine.sequence import SequenceStatus

from conftest import VOCAB, FakeRunner

PROGRESS_STEPS = 200
"""A step in which nothing runs and nothing is reported may happen this many times in a row at most."""


class FaultyRunner(FakeRunner):
    """Fails a forward now and then: raises, returns one row too few, or returns a NaN row."""

    def __init__(self, seed: int, fault_rate: float, **kw) -> None:
        super().__init__(**kw)
        self.rng = random.Random(seed)
        self.fault_rate = fault_rate
        self.faults = 0

    def execute_model(self, batch):
        out = super().execute_model(batch)
        if self.rng.random() >= self.fault_rate:
            return out
        self.faults += 1
        kind = self.rng.choice(["raise", "rows", "nan"])
        if kind == "raise":
            raise RuntimeError("injected fault")
        if kind == "rows" and out.logits.shape[0] > 0:
            raise ValueError(f"forward hook returned {out.logits.shape[0] - 1} rows for {out.logits.shape[0]}")
        if out.logits.shape[0] > 0:
            logits = out.logits.clone()
            logits[self.rng.randrange(logits.shape[0])] = float("nan")
            return type(out)(logits=logits)
        return out


@st.composite
def params_strategy(draw) -> SamplingParams:
    max_tokens = draw(st.integers(1, 16))
    return SamplingParams(
        n=draw(st.sampled_from([1, 1, 2])),
        max_tokens=max_tokens,
        min_tokens=draw(st.sampled_from([0, 0, 2])) if max_tokens >= 2 else 0,
        temperature=draw(st.sampled_from([0.0, 0.0, 1e-30, 0.8, 1.0])),
        top_k=draw(st.sampled_from([0, 3, 10**19])),
        top_p=draw(st.sampled_from([1.0, 0.9])),
        min_p=draw(st.sampled_from([0.0, 0.1])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
        presence_penalty=draw(st.sampled_from([0.0, 0.5])),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        stop=draw(st.sampled_from([[], [], ["7,"], ["1,2,"]])),
        ignore_eos=draw(st.booleans()),
    )


def live_blocks(engine: LLMEngine) -> set[int]:
    alloc = engine.allocator
    return {b for seq in engine.scheduler.running if seq.status is SequenceStatus.RUNNING
            for b in alloc.block_table(seq.seq_id)}


def assert_cache_holds_its_tokens(engine: LLMEngine, runner: FakeRunner) -> None:
    """Every block the prefix cache would serve holds, in the runner's KV, the tokens it is keyed by:
    no forward that failed (or never ran) left a block there whose KV nobody wrote."""
    alloc, bs = engine.allocator, engine.allocator.block_size
    for (_, tokens, _), block in alloc._cache.items():  # the paged allocator's prefix cache
        assert runner.kv[block * bs:(block + 1) * bs].tolist() == list(tokens), f"cached block {block}"


def solo_beams(prompt: list[int], params: BeamSearchParams, num_blocks: int) -> list[list[int]]:
    """The beam search alone on a healthy engine with the same cache."""
    engine = LLMEngine(FakeRunner(num_blocks=num_blocks, block_size=4, max_model_len=64))
    return [s.tokens for s in beam_search(engine, [prompt], params)[0].sequences]


def solo(prompt: list[int], params: SamplingParams, num_blocks: int) -> list[list[int]]:
    """The request alone on a healthy engine with the same cache (a sequence that fills the cache
    ends with "length" at the same point)."""
    engine = LLMEngine(FakeRunner(num_blocks=num_blocks, block_size=4, max_model_len=64))
    engine.add_request("solo", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    return [o.token_ids for o in done["solo"].outputs]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32), fault_rate=st.sampled_from([0.0, 0.15, 0.3]),
       num_blocks=st.integers(5, 12))
def test_random_requests_faults_and_aborts(data, seed, fault_rate, num_blocks):
    torch.manual_seed(seed)
    runner = FaultyRunner(seed, fault_rate, num_blocks=num_blocks, block_size=4, max_model_len=64,
                          max_num_seqs=4, max_num_batched_tokens=16)
    engine = LLMEngine(runner)
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    finished: dict[str, object] = {}
    idle = 0
    for step in range(data.draw(st.integers(10, 60), label="steps")):
        action = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "abort", "beam"]), label="action")
        if action == "add":
            prompt = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=16), label="prompt")
            params = data.draw(params_strategy(), label="params")
            rid = f"r{len(requests)}"
            try:
                engine.add_request(rid, prompt, params)
            except ValueError:
                continue  # e.g. a prompt the tiny cache can never hold: refused, nothing queued
            requests[rid] = (prompt, params)
        elif action == "abort" and engine.get_num_unfinished_requests():
            live = sorted(r for r in requests if engine.is_running(r))
            if live:
                engine.abort_request(data.draw(st.sampled_from(live), label="victim"))
        elif action == "beam":  # runs to its end between two steps, beside the requests holding blocks
            prompts = data.draw(st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12), min_size=1,
                                         max_size=2), label="beam prompts")
            beams = BeamSearchParams(beam_width=data.draw(st.integers(1, 3), label="beam_width"),
                                     max_tokens=data.draw(st.integers(1, 10), label="beam max_tokens"),
                                     ignore_eos=data.draw(st.booleans(), label="beam ignore_eos"))
            faults = runner.faults
            try:
                found = [[s.tokens for s in out.sequences] for out in beam_search(engine, prompts, beams)]
            except (ValueError, RuntimeError):
                found = None  # out of blocks (others hold them) or an injected fault
            assert engine.allocator.stats().used_blocks == len(live_blocks(engine)), "a beam search kept blocks"
            assert_cache_holds_its_tokens(engine, runner)
            if found is not None and runner.faults == faults:
                assert found == [solo_beams(prompt, beams, num_blocks) for prompt in prompts]
        batches = len(runner.batches) + runner.faults
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out
        assert engine.allocator.stats().used_blocks == len(live_blocks(engine))
        progressed = outputs or len(runner.batches) + runner.faults > batches
        idle = 0 if progressed or not engine.has_unfinished_requests() else idle + 1
        assert idle <= PROGRESS_STEPS, "the engine stopped making progress"
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        assert engine.allocator.stats().used_blocks == len(live_blocks(engine))
    assert not engine.has_unfinished_requests(), "requests left unfinished"
    assert engine.allocator.stats().used_blocks == 0
    assert_cache_holds_its_tokens(engine, runner)
    for rid, out in finished.items():
        prompt, params = requests[rid]
        normal = out.error is None and all(o.finish_reason in ("stop", "length") for o in out.outputs)
        if normal and (params.greedy or params.seed is not None):
            assert [o.token_ids for o in out.outputs] == solo(prompt, params, num_blocks), rid
