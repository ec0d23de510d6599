"""``ModelRunner.generate`` (the article's API) is a thin wrapper over the engine: the same tokens as
``LLM.generate``, through the engine that runs the runner (an LLM's, or one of its own), sharing its
KV blocks with ``forward``."""

from __future__ import annotations

import pytest
import torch

from modelrunner import LLM, LLMEngine, ModelRunner, SamplingParams

PROMPTS = [[5, 9, 2, 77, 31], [3, 1, 4]]
CONFIG = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": 1 << 22}


def test_a_bare_runner_generates_on_an_engine_of_its_own(tiny_llama_dir):
    runner = ModelRunner({"model": str(tiny_llama_dir), **CONFIG})
    runner.load_model()
    new = runner.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
    engine = runner.engine()
    assert isinstance(engine, LLMEngine) and runner.engine() is engine  # made once, then reused
    want = LLM(model=str(tiny_llama_dir), **CONFIG).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        use_tqdm=False)
    assert [t.tolist() for t in new] == [o.outputs[0].token_ids for o in want]
    # forward's scratch sequences use the engine's allocator, not a second one over the same KV cache
    assert runner.scratch_allocator() is engine.allocator
    logits = runner.forward(PROMPTS[0])
    assert logits.shape[:2] == (1, len(PROMPTS[0]))
    assert engine.allocator.stats().used_blocks == 0
    # one prompt → one tensor; the engine's SamplingParams fields work (a penalty here)
    single = runner.generate(torch.tensor(PROMPTS[0]), max_new_tokens=4, repetition_penalty=1.3, ignore_eos=True)
    assert isinstance(single, torch.Tensor) and len(single) == 4


def test_an_llm_runner_generates_on_the_llm_engine(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **CONFIG)
    assert llm.runner.engine() is llm.llm_engine
    steps = llm.llm_engine.num_steps
    new = llm.runner.generate(PROMPTS[1], max_new_tokens=3, ignore_eos=True)
    assert llm.llm_engine.num_steps > steps and len(new) == 3


@pytest.mark.parametrize(("kwargs", "message"), [({"n": 2}, "n and max_tokens"), ({"max_tokens": 2}, "max_tokens"),
                                                 ({"temprature": 0.5}, "temprature")])
def test_refused_arguments_are_named(tiny_llama_dir, kwargs, message):
    runner = ModelRunner({"model": str(tiny_llama_dir), **CONFIG})
    runner.load_model()
    with pytest.raises(ValueError, match=message):
        runner.generate(PROMPTS[0], max_new_tokens=2, **kwargs)
