"""The engine loop: many threads submit requests to one engine stepped by its own thread; each
receives exactly its own outputs, equal to running alone; aborts free blocks; a fatal error fails
every request and is reported."""

from __future__ import annotations

import threading

import pytest

from modelrunner import SamplingParams
from modelrunner.engine import LLMEngine
from modelrunner.engine.loop import EngineDeadError, EngineLoop
from modelrunner.errors import FatalError

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _solo(fake_runner, prompt, max_tokens):
    engine = LLMEngine(fake_runner())
    return engine.generate_token_ids([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))[0]


def test_concurrent_submitters_each_get_exactly_their_outputs(fake_runner):
    loop = EngineLoop(LLMEngine(fake_runner(max_num_seqs=4))).start()
    results: dict[str, list] = {}
    prompts = {f"c{i}": ([1 + i, 2 + i, 3], 3 + i % 5) for i in range(16)}

    def client(rid: str) -> None:
        prompt, max_tokens = prompts[rid]
        done = threading.Event()
        seen: list = []

        def consume(output) -> None:
            seen.append(output)
            if output.finished:
                done.set()

        loop.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), on_output=consume).result(5)
        assert done.wait(30)
        results[rid] = seen

    threads = [threading.Thread(target=client, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for rid, (prompt, max_tokens) in prompts.items():
        outs = results[rid]
        assert all(o.request_id == rid for o in outs)
        assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == max_tokens  # no token lost or duplicated
        assert outs[-1].outputs[0].token_ids == _solo(fake_runner, prompt, max_tokens)
    assert loop.snapshot.num_requests == 0 and loop.snapshot.kv_used_blocks == 0
    loop.stop()
    with pytest.raises(EngineDeadError, match="shut down"):
        loop.add_request("late", [1], SamplingParams())


def test_validation_errors_reach_the_submitter_and_aborts_free_blocks(fake_runner):
    runner = fake_runner()
    loop = EngineLoop(LLMEngine(runner)).start()
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        loop.add_request("bad", [1], {"n": 0}).result(5)
    finals = []
    loop.add_request("long", [1, 2], SamplingParams(max_tokens=100, **GREEDY),
                     on_output=lambda o: o.finished and finals.append(o)).result(5)
    assert loop.abort_request("long").result(5) is True
    loop.call(lambda engine: None).result(5)
    for _ in range(100):
        if finals:
            break
        threading.Event().wait(0.02)
    assert finals and finals[0].outputs[0].finish_reason == "abort"
    assert loop.call(lambda engine: engine.allocator.stats().used_blocks).result(5) == 0
    loop.stop()


def test_a_fatal_error_fails_every_request_and_stops_the_loop(fake_runner):
    runner = fake_runner()
    engine = LLMEngine(runner)
    loop = EngineLoop(engine).start()
    finals = []
    original = runner.execute_model

    def die(batch):  # once both requests are in, a worker "dies"
        if len(engine.unfinished_request_ids()) < 2:
            return original(batch)
        raise FatalError("rank 1 was killed by signal SIGKILL")

    runner.execute_model = die
    for rid in ("a", "b"):
        loop.add_request(rid, [1, 2], SamplingParams(max_tokens=30, **GREEDY),
                         on_output=lambda o: o.finished and finals.append(o)).result(5)
    loop._thread.join(10)
    assert not loop.running and "SIGKILL" in str(loop.error)
    assert sorted(o.request_id for o in finals) == ["a", "b"]
    assert all(o.finished and o.outputs[0].finish_reason == "error" and "SIGKILL" in o.error for o in finals)
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        loop.add_request("c", [1], SamplingParams())
